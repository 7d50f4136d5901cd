"""steptune.resilience: ResiHP. Built so far: the workload model, the microbatch/iteration time
predictor, the detectors (ResiHP's, fixed threshold, change point, heartbeat), scored on simulated
runs and on a real 128-GPU trace, and the progressive TP -> PP -> DP planner (pure functions, unit
tested), the baseline policies and the 256-GPU simulator (issue #7), and the first part of the
real runtime (issue #8): ``Runtime`` for live training loops (fail-slow detection, DP rebalancing,
emulated device time), DP fail-stop survival without restarts (``failstop``), a live DP x PP pipeline
whose planner moves layers between processes (``pipelined``), a live DP x TP job with ResiHP's
selective TP exclusion and readmission (``tensorpar``), and the simulator's prediction of the DP and PP
runs (``livesim``). Slow links: injected, detected and localized live in the DP job (no adaptation;
not in the simulator).
"""

from steptune.resilience.detect import (
    Alarm,
    ChangePointDetector,
    FixedThresholdDetector,
    HeartbeatMonitor,
    ResiHPConfig,
    ResiHPDetector,
)
from steptune.resilience.plan import ClusterState, ExecutionPlan
from steptune.resilience.predict import PredictorConfig, WorkloadPredictor
from steptune.resilience.progressive import progressive_replan
from steptune.resilience.runtime import Runtime, RuntimeConfig, SlowFault
from steptune.resilience.workload import LENGTH_PRESETS, LengthDist, StageModel

__all__ = [
    "LENGTH_PRESETS",
    "Alarm",
    "ChangePointDetector",
    "ClusterState",
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
