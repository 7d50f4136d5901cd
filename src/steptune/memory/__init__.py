"""steptune.memory: TapeSAC, automated selective activation checkpointing (dispatcher tape, backward-
slice replay, memory-aware planner). Not built yet (issues #3, #4).
"""

__all__: list[str] = []
