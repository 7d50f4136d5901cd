"""steptune.pipeline: OctoPipe, a pipeline simulator and a bubble-aware co-tuner of partition,
placement and schedule for heterogeneous models.

    from steptune.core.specs import cluster_preset, model_preset
    from steptune.pipeline import anchor, layer_costs, simulate, stage_costs, tune, TuneConfig
    from steptune.pipeline.costs import uniform_partition
    layers = layer_costs(model_preset("llama2-7b"), cluster_preset("dgx-h100").device)
    sched = anchor("zb_h1", 4, 16)                       # torch-compatible orders ("2F0", CSV)
    res = simulate(sched, stage_costs(layers, uniform_partition(layers.num_layers, 4)))
    best = tune(layers, TuneConfig(num_devices=4, num_microbatches=16)).best
"""

from steptune._lazy import lazy_exports

# Loaded on first use (steptune._lazy): `steptune --help` and other areas' verbs need none of it.
_EXPORTS = {
    "ANCHORS": "steptune.pipeline.anchors",
    "anchor": "steptune.pipeline.anchors",
    "LayerCosts": "steptune.pipeline.costs",
    "StageCosts": "steptune.pipeline.costs",
    "balanced_partition": "steptune.pipeline.costs",
    "layer_costs": "steptune.pipeline.costs",
    "split_layer": "steptune.pipeline.costs",
    "stage_costs": "steptune.pipeline.costs",
    "uniform_partition": "steptune.pipeline.costs",
    "ListPolicy": "steptune.pipeline.listsched",
    "list_schedule": "steptune.pipeline.listsched",
    "Action": "steptune.pipeline.schedule",
    "ActionKind": "steptune.pipeline.schedule",
    "Schedule": "steptune.pipeline.schedule",
    "ScheduleError": "steptune.pipeline.schedule",
    "Bubble": "steptune.pipeline.simulate",
    "SimResult": "steptune.pipeline.simulate",
    "simulate": "steptune.pipeline.simulate",
    "Candidate": "steptune.pipeline.tune",
    "TuneConfig": "steptune.pipeline.tune",
    "TuneResult": "steptune.pipeline.tune",
    "tune": "steptune.pipeline.tune",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
