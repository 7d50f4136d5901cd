"""steptune.resilience: ResiHP. Built so far: the workload model, the microbatch/iteration time
predictor, the detectors (ResiHP's, fixed threshold, change point, heartbeat), scored on simulated
runs and on a real 128-GPU trace, and the progressive TP -> PP -> DP planner (pure functions, unit
tested), the baseline policies and the 256-GPU simulator (issue #7), and the first part of the
real runtime (issue #8): ``Runtime`` for live training loops (fail-slow detection, DP rebalancing,
emulated device time), DP fail-stop survival without restarts (``failstop``; in your own loop:
``elastic``), a live DP x PP pipeline
whose planner moves layers between processes (``pipelined``), a live DP x TP job with ResiHP's
selective TP exclusion and readmission (``tensorpar``), and the simulator's prediction of the DP and PP
runs (``livesim``). Slow links: injected, detected and localized live in the DP job (no adaptation;
not in the simulator).
"""

from steptune._lazy import lazy_exports

# Loaded on first use (steptune._lazy): `steptune --help` and other areas' verbs need none of it.
_EXPORTS = {
    "Alarm": "steptune.resilience.detect",
    "ChangePointDetector": "steptune.resilience.detect",
    "FixedThresholdDetector": "steptune.resilience.detect",
    "HeartbeatMonitor": "steptune.resilience.detect",
    "Elastic": "steptune.resilience.elastic",
    "ResiHPConfig": "steptune.resilience.detect",
    "ResiHPDetector": "steptune.resilience.detect",
    "ClusterState": "steptune.resilience.plan",
    "ExecutionPlan": "steptune.resilience.plan",
    "PredictorConfig": "steptune.resilience.predict",
    "WorkloadPredictor": "steptune.resilience.predict",
    "progressive_replan": "steptune.resilience.progressive",
    "Runtime": "steptune.resilience.runtime",
    "RuntimeConfig": "steptune.resilience.runtime",
    "SlowFault": "steptune.resilience.runtime",
    "LENGTH_PRESETS": "steptune.resilience.workload",
    "LengthDist": "steptune.resilience.workload",
    "StageModel": "steptune.resilience.workload",
}

__all__ = [
    "LENGTH_PRESETS",
    "Alarm",
    "ChangePointDetector",
    "ClusterState",
    "Elastic",
    "ExecutionPlan",
    "FixedThresholdDetector",
    "HeartbeatMonitor",
    "LengthDist",
    "PredictorConfig",
    "ResiHPConfig",
    "ResiHPDetector",
    "Runtime",
    "RuntimeConfig",
    "SlowFault",
    "StageModel",
    "WorkloadPredictor",
    "progressive_replan",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
