"""TIDE's cost model (SIMULATED): alpha-beta pieces, wave quantization, buffers vs W, the step model."""

import math

import pytest

from steptune.comm.constants import CommConstants
from steptune.comm.costmodel import layer_comm, wave_slowdown
from steptune.comm.simreport import buffer_sweep, headline, simulate_all
from steptune.comm.stepmodel import StepConfig, simulate_step
from steptune.core.cost import Algorithm, Collective, group_collective_time
from steptune.core.specs import cluster_preset, model_preset

P = 855_700_000  # a Llama-3.1 70B decoder layer
C = CommConstants()


def test_collectives_are_alpha_beta_on_the_right_bytes():
    cl = cluster_preset("dgx-h100")
    stock, tide = layer_comm(P, cl, 64, "stock", C), layer_comm(P, cl, 64, "tide", C)
    assert stock.ag_s == group_collective_time(Collective.ALL_GATHER, 2 * P, 64, cl)
    assert stock.rs_s == group_collective_time(Collective.REDUCE_SCATTER, 4 * P, 64, cl)  # fp32 input
    assert tide.rs_s == group_collective_time(Collective.REDUCE_SCATTER, 2 * P, 64, cl)  # bf16 wire
    # recursive doubling: same bytes as the ring, log2 instead of linear latency terms
    assert tide.ag_s == group_collective_time(Collective.ALL_GATHER, 2 * P, 64, cl, Algorithm.RECURSIVE)
    # 8 nodes: the inter-node ring has 7 latency terms, recursive doubling log2(8) = 3
    assert stock.ag_s - tide.ag_s == pytest.approx(4 * cl.inter.latency)


def test_layout_copies_only_in_stock_and_symmmem():
    cl = cluster_preset("dgx-h200")
    c = C.for_device(cl.device)
    for system in ("stock", "symmmem"):
        lc = layer_comm(P, cl, 64, system, C)
        assert lc.copy_out_s == pytest.approx(2 * P / c.copy_out_bytes_per_s)
        assert lc.chunk_cat_s == pytest.approx(P / c.chunk_cat_elems_per_s)
    tide = layer_comm(P, cl, 64, "tide", C)
    assert tide.copy_out_s == tide.chunk_cat_s == 0.0
    assert tide.copy_in_s == pytest.approx(P / 64 / c.cast_elems_per_s)


def test_sms_held_by_each_system():
    cl = cluster_preset("dgx-h100")
    stock, symm, tide = (layer_comm(P, cl, 64, s, C) for s in ("stock", "symmmem", "tide"))
    assert stock.ag_sms == stock.rs_sms == C.nccl_ctas
    assert symm.ag_sms == 0 and symm.rs_sms == C.symm_rs_ctas  # copy-engine all-gather
    assert tide.ag_sms == 0 and 0 < tide.rs_sms < C.tide_acc_ctas  # short CTAs, part of the time


def test_wave_quantization():
    assert wave_slowdown(132, 132, 0) == 1.0
    assert wave_slowdown(132, 132, 16) == 2.0  # a single-wave GEMM needs a second wave
    assert wave_slowdown(4096, 132, 16) == math.ceil(4096 / 116) / math.ceil(4096 / 132)
    assert wave_slowdown(100, 132, 16) == 1.0  # fits in the free SMs
    assert wave_slowdown(0, 132, 16) == 1.0


def test_rs_buffer_grows_with_w_for_stock_and_stays_flat_for_tide():
    sweep = buffer_sweep(P // 16, (16, 32, 64), "dgx-h100", C)
    assert sweep["stock"][64] == pytest.approx(4 * sweep["stock"][16], rel=0.01)
    assert sweep["tide"][64] == pytest.approx(sweep["tide"][16], rel=0.10)
    assert buffer_sweep(P // 16, (16, 64), "dgx-h100", C, slot_reuse=True)["tide"] == {16: 0, 64: 0}


def test_step_model_bounds_and_orderings():
    model, cl = model_preset("llama3.1-8b"), cluster_preset("dgx-h100")
    res = {s: simulate_step(model, cl, StepConfig(num_gpus=16), s) for s in ("stock", "symmmem", "tide")}
    for r in res.values():
        assert r.step_time_s >= r.compute_s  # compute is a lower bound
        assert r.exposed_comm_s >= -1e-9
    assert res["tide"].layout_share == 0.0 < res["stock"].layout_share
    assert res["tide"].step_time_s < res["symmmem"].step_time_s <= res["stock"].step_time_s
    no_interference = CommConstants(nccl_ctas=0, symm_rs_ctas=0, tide_acc_ctas=0)
    quiet = simulate_step(model, cl, StepConfig(num_gpus=16), "stock", no_interference)
    assert quiet.interference_s == 0.0 and quiet.step_time_s < res["stock"].step_time_s


def test_step_model_refuses_more_gpus_than_the_cluster():
    with pytest.raises(ValueError, match="exceeds"):
        simulate_step(
            model_preset("llama3.1-8b"), cluster_preset("dgx-h100"), StepConfig(num_gpus=128), "tide"
        )


def test_simulate_all_grows_the_cluster_when_asked_for_more_gpus():
    res = simulate_all("llama3.1-8b", "dgx-h100", 128, C)
    assert set(res) == {"stock", "symmmem", "tide"}


def test_headline_reports_the_paper_quantities():
    h = headline()
    assert 0 < h["stock_layout_share"] < 0.5
    assert h["rs_sm_time_ratio"] > 1 and h["single_wave_gemm_slowdown"] == 1.0
    assert set(h["rs_buffer_at_fixed_output"]) == {"stock", "symmmem", "tide"}


def test_tide_config_and_a_one_gpu_simulation_are_refused_with_what_to_change(capsys):
    from steptune.cli import main
    from steptune.comm.config import TideConfig

    for kw, says in (
        ({"align_bytes": 0}, "align_bytes must be a power of two"),  # a failed self-test before
        ({"align_bytes": 3}, "align_bytes must be a power of two"),
        ({"align_bytes": 2}, "a multiple of fp32.s 4 bytes"),  # a crash in the first forward of fp32 before
        ({"align_bytes": 1}, "align_bytes must be a power of two >= 4"),  # a misleading self-test failure
        ({"max_inflight_bytes": 0}, "max_inflight_bytes must be >= 1"),
        ({"max_inflight_bytes": -1}, "max_inflight_bytes must be >= 1"),
    ):
        with pytest.raises(ValueError, match=says):
            TideConfig(**kw)
    for verb in (["simulate"], ["calibrate", "x.json"]):
        assert main(["comm", *verb, "--gpus", "1"]) == 2  # showed a TIDE win where TIDE never runs
        assert "W >= 2" in capsys.readouterr().err
