"""steptune.kernels: SpecGen, agentic kernel optimization with speculative generation and elastic eval pools.

Built (issue #11): KernelBench-format problems, C / Triton-interpreter / CUDA backends, a sandboxed
validation and profiling pool with roles and priorities, static and run-time cheat checks, an
OpenAI-compatible streaming client and a trace-replay server (`steptune.kernels.llm`, imported on demand).
Not built yet (issue #12): the speculative orchestrator, elastic allocation, KV tier and simulator.
"""

from steptune.kernels.checks import Finding, static_check
from steptune.kernels.pool import VERDICTS, EvalPool, PoolConfig, Result
from steptune.kernels.problems import Problem, builtin_problems, load_problem

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
