"""`steptune comm` verbs."""

from __future__ import annotations

from typing import Any

from steptune._pending import register_pending


def register(sub: Any) -> None:
    register_pending(
        sub,
        area="comm",
        system="TIDE",
        summary="zero-copy, layout-aware FSDP2 all-gather and bf16->fp32 reduce-scatter",
        issues="#9, #10",
        verbs="bench, model",
    )
