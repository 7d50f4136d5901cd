"""`steptune resilience` verbs."""

from __future__ import annotations

from typing import Any

from steptune._pending import register_pending


def register(sub: Any) -> None:
    register_pending(
        sub,
        area="resilience",
        system="ResiHP",
        summary="workload-aware failure detection and TP/PP/DP adaptation",
        issues="#7, #8",
        verbs="detect, replay, bench",
    )
