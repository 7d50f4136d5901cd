"""steptune.kernels: SpecGen, agentic kernel optimization with speculative generation and elastic eval pools.

Built (issue #11): KernelBench-format problems, C / Triton-interpreter / CUDA backends, a sandboxed
validation and profiling pool with roles and priorities, static and run-time cheat checks, an
OpenAI-compatible streaming client and a trace-replay server (`steptune.kernels.llm`, imported on demand).
Not built yet (issue #12): the speculative orchestrator, elastic allocation, KV tier and simulator.
"""

from steptune._lazy import lazy_exports

# Loaded on first use (steptune._lazy): `steptune --help` and other areas' verbs need none of it.
_EXPORTS = {
    "Finding": "steptune.kernels.checks",
    "static_check": "steptune.kernels.checks",
    "VERDICTS": "steptune.kernels.pool",
    "EvalPool": "steptune.kernels.pool",
    "PoolConfig": "steptune.kernels.pool",
    "Result": "steptune.kernels.pool",
    "Problem": "steptune.kernels.problems",
    "builtin_problems": "steptune.kernels.problems",
    "load_problem": "steptune.kernels.problems",
}

__all__ = [
    "VERDICTS",
    "EvalPool",
    "Finding",
    "PoolConfig",
    "Problem",
    "Result",
    "builtin_problems",
    "load_problem",
    "static_check",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
