"""Baseline recovery policies for the cluster simulator, re-implemented from their papers. SIMULATED.

Each is a ``sim.Policy``; docs/resilience.md lists every fidelity choice. In brief:

- ``ReCycle`` (SOSP'24): a fail-stop loses the whole stage worker (its TP group); the stage's
  microbatches are rerouted to the same stage of the DP peers. Their forward and input-gradient
  work runs in the peers' steady state; the weight gradients are deferred into the 1F1B bubbles
  (decoupled backprop) up to ``absorb`` x the idle time. A stage with no surviving peer forces a
  checkpoint restart. Blind to fail-slow.
- ``Oobleck`` (SOSP'23): node-granular loss (the failed device's whole node leaves), the hit pipeline
  is re-instantiated from a template on its remaining devices (same stages, the largest power-of-two
  TP degree that fits heads and memory, a balanced partition), the global batch is redistributed by
  pipeline throughput. Blind to fail-slow.
- ``Greyhound`` (ATC'25, FALCON): change-point detection on iteration time (sees a fail-slow only if
  it raises the step by >= 10%), validation stalls on false alarms, ski-rental escalation S1 ignore ->
  S2 DP microbatch redistribution -> S3 layer repartition -> S4 checkpoint restart without the slow
  replica. Fail-stop: checkpoint restart (it is not a fail-stop system).
- ``Adaptra``: on a detected slowdown, re-schedules the pipeline (deeper warm-up so upstream stages
  keep working through a slow stage's delays); no device, layer or batch changes. Fail-stop: restart.
- ``Strengthened``: ReCycle or Oobleck for fail-stop plus Greyhound's detection and DP
  redistribution for fail-slow (the "strengthened" baselines of the ResiHP paper).
- ``MalleusLite``: on every change, an asynchronous full re-plan (device grouping, layer partition,
  batch counts: ResiHP's planner from the first plan with no ski-rental gate) that lands
  ``planning_s`` after detection; fail-stop: checkpoint restart.
"""

from __future__ import annotations

from collections.abc import Callable

from steptune.resilience.baselines.failslow import (
    Adaptra,
    Greyhound,
    MalleusLite,
    Strengthened,
    adaptra_step_time,
)
from steptune.resilience.baselines.failstop import Oobleck, ReCycle, oobleck_reinstantiate, recycle_step_time
from steptune.resilience.oracle import Oracle

__all__ = [
    "Adaptra",
    "Greyhound",
    "MalleusLite",
    "Oobleck",
    "ReCycle",
    "Strengthened",
    "adaptra_step_time",
    "baseline",
    "oobleck_reinstantiate",
    "oracle",
    "recycle_step_time",
]


def oracle() -> Oracle:
    """The bound for the bench: best plan, priced at the best of 1F1B, ReCycle's rerouting and
    Adaptra's rescheduling, every change seen at once and switched for free."""
    return Oracle(extra_prices=(recycle_step_time, adaptra_step_time))


def baseline(name: str, **kwargs: float) -> object:
    """A fresh baseline policy by name (see ``BASELINES``)."""
    makers: dict[str, Callable[[], object]] = {
        "recycle": lambda: ReCycle(**kwargs),
        "oobleck": lambda: Oobleck(**kwargs),
        "greyhound": lambda: Greyhound(**kwargs),
        "adaptra": lambda: Adaptra(**kwargs),
        "strengthened-recycle": lambda: Strengthened(ReCycle(), **kwargs),
        "strengthened-oobleck": lambda: Strengthened(Oobleck(), **kwargs),
        "malleus-lite": lambda: MalleusLite(**kwargs),
    }
    if name not in makers:
        raise ValueError(f"unknown baseline {name!r}; choose one of {sorted(makers)}")
    return makers[name]()
