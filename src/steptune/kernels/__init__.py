"""steptune.kernels: SpecGen, agentic kernel optimization with speculative generation and elastic eval
pools. Not built yet (issues #11, #12).
"""

__all__: list[str] = []
