"""steptune.memory: TapeSAC, automated selective activation checkpointing by dispatcher tape.

    from steptune.memory import apply_tapesac_, TapeSACConfig
    handle = apply_tapesac_(model, TapeSACConfig(blocks="model.layers.*"))   # no forward edits
    ...train...
    handle.remove()

Each block's forward is recorded at the dispatcher; in backward only the producers of the values
autograd reads are replayed (issue #3). The memory-aware planner is issue #4.
"""

from steptune.memory.apply import TapeSAC, TapeSACConfig, apply_tapesac_, find_blocks
from steptune.memory.frame import ReplayStats
from steptune.memory.tape import TapeSACError

__all__ = ["ReplayStats", "TapeSAC", "TapeSACConfig", "TapeSACError", "apply_tapesac_", "find_blocks"]
