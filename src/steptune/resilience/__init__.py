"""steptune.resilience: ResiHP. Built so far: the workload model, the microbatch/iteration time
predictor and the detectors (ResiHP's, fixed threshold, change point, heartbeat), scored on
simulated runs and on a real 128-GPU trace. Not built yet: the adaptive planner, the baseline
policies and the 256-GPU simulator (issue #7), and the real runtime (issue #8).
"""

from steptune.resilience.detect import (
    Alarm,
    ChangePointDetector,
    FixedThresholdDetector,
    HeartbeatMonitor,
    ResiHPConfig,
    ResiHPDetector,
)
from steptune.resilience.predict import PredictorConfig, WorkloadPredictor
from steptune.resilience.workload import LENGTH_PRESETS, LengthDist, StageModel

__all__ = [
    "LENGTH_PRESETS",
    "Alarm",
    "ChangePointDetector",
    "FixedThresholdDetector",
    "HeartbeatMonitor",
    "LengthDist",
    "PredictorConfig",
    "ResiHPConfig",
    "ResiHPDetector",
    "StageModel",
    "WorkloadPredictor",
]
