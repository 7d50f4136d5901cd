"""Checks found missing by a user sweep: measuring a model TapeSAC already wraps, SavePlan contents,
limit values, the unplanned-signature warning, and options that void a plan's limit."""

import warnings

import pytest
import torch

from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.measure import measure_peak

pytestmark = pytest.mark.timeout(60)


class _MLP(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x, mask=None):
        h = self.b(torch.nn.functional.gelu(self.a(x)))
        if mask is not None:
            h = h * mask
        return x + self.drop(h)


class _Net(torch.nn.Module):
    def __init__(self, n=2, dropout=0.0):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MLP(dropout) for _ in range(n))

    def forward(self, x, mask=None):
        for block in self.blocks:
            x = block(x, mask=mask)
        return x.pow(2).mean()


def _net(n=2, dropout=0.0):
    torch.manual_seed(0)
    return _Net(n, dropout), {"x": torch.randn(4, 8, 16)}


def test_measuring_a_model_tapesac_already_wraps_is_refused():
    # measure_peak(model, batch, "no_ac") measured TapeSAC's replay-only peak (a sweep): calibrating from it
    # put every fraction at the floor
    model, batch = _net()
    handle = apply_tapesac_(model, TapeSACConfig(blocks="blocks.*"))
    for policy in ("no_ac", "full_ac", "tapesac_replay"):
        with pytest.raises(ValueError, match=r"already applied.*\.remove\(\)"):
            measure_peak(model, batch, policy, blocks="blocks.*")
    handle.remove()
    assert measure_peak(model, batch, "no_ac", blocks="blocks.*")[0] > 0


def _step(model, batch, plan):
    handle = apply_tapesac_(model, TapeSACConfig(blocks="blocks.*", plan=plan))
    try:
        model(**batch).backward()
    finally:
        handle.remove()
    return handle


def test_a_save_plan_is_checked_when_applied():
    # a sweep: a misspelled name and negative or out-of-range indices were ignored silently; a list value,
    # None, a list of saves or string indices failed deep in the first forward with a raw TypeError
    from steptune.memory.apply import SavePlan

    model, batch = _net()
    cases = [
        (SavePlan({"block.0": frozenset({0})}), ValueError, r"names no block.*did you mean 'blocks\.0'"),
        (SavePlan({"blocks.0": frozenset({-1})}), ValueError, "non-negative ints"),
        (SavePlan({"blocks.0": frozenset({"0"})}), ValueError, "non-negative ints"),
        (SavePlan({"blocks.0": None}), TypeError, r"collection of pack indices"),
        (SavePlan(None), TypeError, "must be a dict"),
        (SavePlan([1, 2]), TypeError, "must be a dict"),
        (SavePlan({3: frozenset()}), TypeError, "keys are block FQNs"),
    ]
    for plan, error, message in cases:
        with pytest.raises(error, match=message):
            apply_tapesac_(model, TapeSACConfig(blocks="blocks.*", plan=plan))
        assert getattr(model, "_tapesac", None) is None  # refused before anything was wrapped
    with pytest.raises(ValueError, match=r"keeps pack index 999, but the block packs \d+ values"):
        _step(model, batch, SavePlan({"blocks.0": frozenset({999})}))
    handle = _step(model, batch, SavePlan({"blocks.0": [0, 1]}))  # a list is taken as a frozenset
    assert handle.config.plan.saves == {"blocks.0": frozenset({0, 1})}
    _step(model, batch, SavePlan({}))


def test_the_python_api_checks_limits_as_the_cli_does():
    # a sweep: "8MiB" gave a TypeError deep in plan_saves, nan and inf raw errors, 0.5 (the CLI's fraction
    # form) "no plan fits a peak limit of 0 B", and a numpy scalar was stored as the plan's limit
    import math

    import numpy as np

    from steptune.memory.cli import _parse_limit
    from steptune.memory.plan import limit_bytes, plan_saves, plan_within

    assert limit_bytes("8MiB") == 8 * 2**20 and limit_bytes(123456.7) == 123456
    for value in (np.int64(5000), torch.tensor(5000), np.float32(5000.0)):
        got = limit_bytes(value)
        assert got == 5000 and type(got) is int
    for value, error, message in [
        (0.5, ValueError, "the fraction form is the CLI's"),
        ("0.5", ValueError, "the fraction form is the CLI's"),
        (math.nan, ValueError, "positive, finite"),
        (math.inf, ValueError, "positive, finite"),
        (-5, ValueError, "positive, finite"),
        (True, TypeError, "number of bytes"),
        (None, TypeError, "number of bytes"),
        ("lots", ValueError, "write bytes"),
    ]:
        with pytest.raises(error, match=message):
            limit_bytes(value)
        with pytest.raises(error, match=message):
            plan_saves({}, None, value)
        with pytest.raises(error, match=message):
            plan_within({}, None, value, lambda plan: 0)
    assert _parse_limit("0.5") == 0.5 and _parse_limit("1KiB") == 1024
    with pytest.raises(ValueError, match="--limit"):
        _parse_limit("nan")


def test_a_call_the_plan_has_no_entry_for_is_told_apart_from_the_plans_signature():
    # a sweep: the warning guessed "a new batch or sequence shape?" for a plan made in eval mode, a batch
    # with an attention mask added, and a compiled call (other strides); it now names what differs
    from steptune.memory.apply import SavePlan
    from steptune.memory.profile import profile_model

    model, batch = _net()
    model.eval()
    with pytest.warns(
        UserWarning, match=r"profile_model: block\(s\) \['blocks.0', 'blocks.1'\] are in eval mode"
    ):
        eval_plan = SavePlan({k: frozenset() for k in profile_model(model, batch, blocks="blocks.*")})
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # profiled in training mode: quiet
        plan = SavePlan({k: frozenset() for k in profile_model(model, batch, blocks="blocks.*")})
    cases = [
        (eval_plan, batch, "the block is in training mode and the plan was made in eval mode"),
        (
            plan,
            {"x": torch.randn(4, 9, 16)},
            r"argument args\[0\] has shape \(4, 9, 16\) where the plan's has",
        ),
        (plan, {"x": batch["x"].transpose(0, 1).contiguous().transpose(0, 1)}, "args\\[0\\] has strides"),
        (
            plan,
            dict(batch, mask=torch.ones(4, 8, 16)),
            "argument mask is a tensor where the plan's call passed None",
        ),
    ]
    for save_plan, inputs, message in cases:
        with pytest.warns(UserWarning, match=message) as caught:
            _step(model, inputs, save_plan)
        said = [str(w.message) for w in caught if "no entry for" in str(w.message)]
        assert len(said) == 1, said  # one warning, naming the difference, not the old guess
        assert "shape" in message or "a new batch or sequence shape?" not in said[0], said


def test_save_ops_or_save_fn_with_a_plan_warn_that_its_limit_no_longer_holds():
    # a sweep: a plan for 7.97 MB measured 9.5 MB with save_ops={"aten.mm"} added, silently
    from steptune.memory.apply import SavePlan

    model, _ = _net()
    for extra in ({"save_ops": {"aten.mm"}}, {"save_fn": lambda node: True}):
        with pytest.warns(UserWarning, match="the plan's step-peak limit no longer holds") as caught:
            handle = apply_tapesac_(model, TapeSACConfig(blocks="blocks.*", plan=SavePlan({}), **extra))
        handle.remove()
        [warned] = [str(w.message) for w in caught if "step-peak limit" in str(w.message)]
        assert f"TapeSACConfig({next(iter(extra))}=..., plan=...)" in warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_tapesac_(model, TapeSACConfig(blocks="blocks.*", save_ops={"aten.mm"})).remove()
    assert not [w for w in caught if "step-peak limit" in str(w.message)]  # no plan: nothing to void


def test_a_plan_applied_to_a_model_with_another_number_of_blocks_warns():
    # a sweep: a 3-layer model's plan on a 4-layer one broke the limit silently (save_plan dropped the
    # plan's limit and block count)
    from steptune.memory.plan import PeakModel, replay_only_plan
    from steptune.memory.profile import profile_model

    model, batch = _net(2)
    profiles = profile_model(model, batch, blocks="blocks.*")
    saves = replay_only_plan(profiles, PeakModel(base=0), 10**6).save_plan(profiles)
    assert (saves.limit, saves.num_blocks) == (10**6, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_tapesac_(model, TapeSACConfig(blocks="blocks.*", plan=saves)).remove()
    deeper, _ = _net(3)
    with pytest.warns(
        UserWarning, match=r"made for a model with 2 blocks and this one has 3.*\(1000000 bytes\)"
    ):
        apply_tapesac_(deeper, TapeSACConfig(blocks="blocks.*", plan=saves)).remove()
    # a block called twice (shared weights) is one block, not two (a review: the count was of recordings)
    model.forward = lambda x, mask=None: model.blocks[1](model.blocks[1](model.blocks[0](x))).pow(2).mean()
    profiles = profile_model(model, batch, blocks="blocks.*")
    saves = replay_only_plan(profiles, PeakModel(base=0), 10**6).save_plan(profiles)
    assert saves.num_blocks == 2


def test_plan_within_measures_each_distinct_plan_once_and_notes_sizes_exactly():
    # a sweep: after a budget cut of a few KiB plan_within measured the same plan again, and its notes
    # printed sizes to 0.1 MiB, so consecutive lines read the same
    from steptune.memory.plan import calibrate, plan_within
    from steptune.memory.profile import profile_model

    model, batch = _net(2)
    profiles = profile_model(model, batch, blocks="blocks.*")
    peak = calibrate(profiles, 10**6)
    limit = 2 * 10**6
    measured = []

    def over(plan):  # every plan measures 10 bytes over: the cuts are tiny
        measured.append(tuple(tuple(sorted(b.keep)) for b in plan.blocks.values()))
        return limit + 10

    with pytest.raises(ValueError, match=r"2,000,010 B \(1\.9 MiB\)") as err:
        plan_within(profiles, peak, limit, over)
    assert len(measured) == len(set(measured)), measured
    assert "10 B (10 B) over the limit" in str(err.value)
