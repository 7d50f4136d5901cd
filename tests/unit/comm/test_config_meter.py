"""TideConfig's type checks and nested meters (a session-47 sweep)."""

import pytest
import torch

from steptune.comm.config import TideConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rs_chunk_numel", 1e3, r"rs_chunk_numel must be a whole number \(int\), got 1000.0 \(write 1000\)"),
        ("rs_num_slots", True, "rs_num_slots must be a whole number"),
        ("max_inflight_bytes", 100.5, "max_inflight_bytes must be a whole number"),
        ("self_test", "no", "self_test must be True or False"),
        ("slot_reuse", 0, "slot_reuse must be True or False"),
    ],
)
def test_config_refuses_values_of_the_wrong_type(field, value, message):
    # rs_chunk_numel=1e3 (YAML's float) passed enable_tide's self-test, then failed as a slice index in the
    # first backward
    with pytest.raises(TypeError, match=message):
        TideConfig(**{field: value})
    TideConfig(rs_chunk_numel=1000, rs_num_slots=3, max_inflight_bytes=101, self_test=False, slot_reuse=False)


def test_nested_measure_blocks_each_count_everything_inside_them():
    # the outer meter counted only what ran outside the inner block (6 of 12 all-gathers in a sweep)
    from steptune.comm import fsdp

    with fsdp.measure() as outer:
        fsdp._meter().count("tide_all_gather")
        with fsdp.measure() as inner:
            meter = fsdp._meter()
            meter.count("tide_all_gather")
            meter.add_wire("all_gather", torch.bfloat16, 10)
            meter.add_staging(8, 4)
            with meter.copies:
                torch.zeros(3).copy_(torch.ones(3))
    assert outer.calls["tide_all_gather"] == 2 and inner.calls["tide_all_gather"] == 1
    for m in (outer, inner):
        assert m.summary()["wire_bytes"] == {"all_gather": {"bfloat16": 10}}
        assert m.rs_staging_allocated == 4 and m.copies.total("layout") == 12
    assert fsdp._meter() is None
