"""Registration for an area whose system is not built yet: its help says so, running it fails."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register_pending(sub: Any, *, area: str, system: str, summary: str, issues: str, verbs: str) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        area,
        help=f"{system}: {summary} (not yet built)",
        description=f"{system}: {summary}\n\nStatus: not yet built (tracked in issues {issues}). "
        f"Planned verbs: {verbs}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    def run(args: argparse.Namespace) -> int:
        print(
            f"steptune {area}: {system} is not built yet (issues {issues}); nothing was run.", file=sys.stderr
        )
        return 2

    p.set_defaults(func=run)
