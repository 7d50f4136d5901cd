"""`steptune memory` verbs."""

from __future__ import annotations

from typing import Any

from steptune._pending import register_pending


def register(sub: Any) -> None:
    register_pending(
        sub,
        area="memory",
        system="TapeSAC",
        summary=(
            "automated selective activation checkpointing (dispatcher tape, backward-slice "
            "replay, memory-aware planner)"
        ),
        issues="#3, #4",
        verbs="plan, pareto, bench",
    )
