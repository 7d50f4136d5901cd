"""`steptune pipeline` verbs."""

from __future__ import annotations

from typing import Any

from steptune._pending import register_pending


def register(sub: Any) -> None:
    register_pending(
        sub,
        area="pipeline",
        system="OctoPipe",
        summary="pipeline simulator, bubble-aware partition/placement/schedule tuner, executor",
        issues="#5, #6",
        verbs="simulate, tune, plot, bench",
    )
