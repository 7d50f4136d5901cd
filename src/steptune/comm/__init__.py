"""steptune.comm: TIDE, zero-copy, layout-aware FSDP2 all-gather and bf16->fp32 reduce-scatter. Not
built yet (issues #9, #10).
"""

__all__: list[str] = []
