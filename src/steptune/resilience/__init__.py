"""steptune.resilience: ResiHP, workload-aware failure detection and TP/PP/DP adaptation. Not built yet
(issues #7, #8).
"""

__all__: list[str] = []
