"""steptune.pipeline: OctoPipe, a pipeline simulator and a bubble-aware co-tuner of partition,
placement and schedule for heterogeneous models.

    from steptune.pipeline import anchor, layer_costs, simulate, stage_costs, tune, TuneConfig
    sched = anchor("zb_h1", 4, 16)                       # torch-compatible orders ("2F0", CSV)
    res = simulate(sched, stage_costs(layers, sched.partition or (8, 8, 8, 10)))
    best = tune(layers, TuneConfig(num_devices=4, num_microbatches=16)).best
"""

from steptune.pipeline.anchors import ANCHORS, anchor
from steptune.pipeline.costs import (
    LayerCosts,
    StageCosts,
    balanced_partition,
    layer_costs,
    split_layer,
    stage_costs,
    uniform_partition,
)
from steptune.pipeline.listsched import ListPolicy, list_schedule
from steptune.pipeline.schedule import Action, ActionKind, Schedule, ScheduleError
from steptune.pipeline.simulate import Bubble, SimResult, simulate
from steptune.pipeline.tune import Candidate, TuneConfig, TuneResult, tune

__all__ = [
    "ANCHORS",
    "Action",
    "ActionKind",
    "Bubble",
    "Candidate",
    "LayerCosts",
    "ListPolicy",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StageCosts",
    "TuneConfig",
    "TuneResult",
    "anchor",
    "balanced_partition",
    "layer_costs",
    "list_schedule",
    "simulate",
    "split_layer",
    "stage_costs",
    "tune",
    "uniform_partition",
]
