"""`steptune kernels` verbs."""

from __future__ import annotations

from typing import Any

from steptune._pending import register_pending


def register(sub: Any) -> None:
    register_pending(
        sub,
        area="kernels",
        system="SpecGen",
        summary="agentic kernel optimization with speculative generation and elastic eval pools",
        issues="#11, #12",
        verbs="optimize, eval, bench",
    )
