"""steptune.memory: TapeSAC, automated selective activation checkpointing by dispatcher tape.

    from steptune.memory import apply_tapesac_, TapeSACConfig
    handle = apply_tapesac_(model, TapeSACConfig(blocks="model.layers.*"))   # no forward edits
    ...train...
    handle.remove()

Each block's forward is recorded at the dispatcher; in backward only the producers of the values
autograd reads are replayed (issue #3). The memory-aware planner is issue #4.
"""

from steptune._lazy import lazy_exports

# Loaded on first use (steptune._lazy): `steptune --help` and other areas' verbs need none of it.
_EXPORTS = {
    "TapeSAC": "steptune.memory.apply",
    "TapeSACConfig": "steptune.memory.apply",
    "apply_tapesac_": "steptune.memory.apply",
    "find_blocks": "steptune.memory.apply",
    "ReplayStats": "steptune.memory.frame",
    "TapeSACError": "steptune.memory.tape",
}

__all__ = ["ReplayStats", "TapeSAC", "TapeSACConfig", "TapeSACError", "apply_tapesac_", "find_blocks"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
