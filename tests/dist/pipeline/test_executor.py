"""The unified executor on real gloo groups (thread ranks): exact gradients, fuzzing, refusals, watchdog."""

import random
import time

import pytest
import torch

from steptune.pipeline import anchors
from steptune.pipeline.costs import LayerCosts, StageCosts
from steptune.pipeline.executor import ExecutorConfig, PipelineExecutor, check_schedule
from steptune.pipeline.fuzz import invalid_schedules, random_schedule
from steptune.pipeline.listsched import ListPolicy, list_schedule
from steptune.pipeline.schedule import ScheduleError
from steptune.pipeline.stages import (
    boundary_shape,
    lm_loss,
    sleep_layers,
    split_layers,
    tiny_decoder_layers,
)
from steptune.testing import RankFailure, run_threads

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

VOCAB, SEQ, BATCH = 64, 8, 2


def decoder_data(num_microbatches, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(num_microbatches)]
    ys = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(num_microbatches)]
    return xs, ys


def decoder(num_blocks):
    return tiny_decoder_layers(
        vocab=VOCAB, hidden=16, num_layers=num_blocks, num_heads=2, seq_len=SEQ, seed=0
    )


def reference_grads(num_blocks, xs, ys):
    layers = decoder(num_blocks)
    model = torch.nn.Sequential(*layers)
    for x, y in zip(xs, ys, strict=True):
        (lm_loss(model(x), y) / len(xs)).backward()
    return [p.grad.clone() for layer in layers for p in layer.parameters()]


def run_pipeline(schedule, layers, xs, ys, loss_fn, *, timeout=60.0):
    assert schedule.partition is not None
    stages = split_layers(layers, schedule.partition)
    meta = boundary_shape(stages, xs[0])

    def rank_fn(rank, group):
        mine = {s: stages[s] for s in schedule.stages_of(rank)}
        ex = PipelineExecutor(
            schedule,
            mine,
            rank=rank,
            group=group,
            boundary=meta,
            loss_fn=loss_fn,
            config=ExecutorConfig(timeout=timeout),
        )
        return ex.step(xs if 0 in mine else None, ys if schedule.num_stages - 1 in mine else None)

    return run_threads(rank_fn, schedule.num_devices, timeout=timeout + 30)


def max_rel_diff(layers, ref):
    got = [p.grad for layer in layers for p in layer.parameters()]
    return max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, ref, strict=True)
    )


def with_partition(schedule, partition):
    from dataclasses import replace

    return replace(schedule, partition=tuple(partition)).validate()


def uniform(n_units, n_stages):
    q, r = divmod(n_units, n_stages)
    return [q + (1 if k < r else 0) for k in range(n_stages)]


ANCHOR_CASES = [
    ("gpipe", lambda p, m: anchors.gpipe(p, m)),
    ("1f1b", lambda p, m: anchors.one_f_one_b(p, m)),
    ("zb_h1", lambda p, m: anchors.zb_h1(p, m)),
    ("interleaved_1f1b", lambda p, m: anchors.interleaved_1f1b(p, m, num_chunks=2)),
    ("zb_v", lambda p, m: anchors.zb_v(p, m)),
    ("dualpipe_v", lambda p, m: anchors.dualpipe_v(p, m)),
]


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("name,make", ANCHOR_CASES, ids=[c[0] for c in ANCHOR_CASES])
def test_anchor_gradients_equal_single_process(name, make, num_ranks):
    m = 2 * num_ranks
    sched = make(num_ranks, m)
    n_units = max(sched.num_stages, 4) + 2  # embedding + blocks + head
    sched = with_partition(sched, uniform(n_units, sched.num_stages))
    xs, ys = decoder_data(m)
    ref = reference_grads(n_units - 2, xs, ys)
    layers = decoder(n_units - 2)
    losses = run_pipeline(sched, layers, xs, ys, lm_loss)
    assert max_rel_diff(layers, ref) <= 1e-6
    last_rank = sched.placement[-1]
    assert len(losses[last_rank]) == m and all(x > 0 for x in losses[last_rank])


IRREGULAR = {
    "uneven-seq": ((0, 1, 1, 1), (2, 1, 1, 2)),  # rank 1 holds three consecutive stages
    "v": ((0, 1, 1, 0), (1, 2, 2, 1)),
    "neither-v-nor-loop": ((0, 1, 1, 2, 0), (1, 1, 2, 1, 1)),
    "uneven-4-ranks": ((0, 1, 2, 2, 2, 3), (2, 1, 1, 1, 1, 2)),
    "neither-4-ranks": ((0, 1, 2, 3, 1, 0, 2), (1, 1, 1, 1, 2, 1, 1)),
}


@pytest.mark.parametrize("case", sorted(IRREGULAR))
@pytest.mark.parametrize("split_backward", [True, False])
def test_tuned_irregular_schedules_exact(case, split_backward):
    placement, partition = IRREGULAR[case]
    n = len(placement)
    rng = random.Random(7)
    costs = StageCosts(
        f=tuple(rng.uniform(1, 3) for _ in range(n)),
        i=tuple(rng.uniform(1, 3) for _ in range(n)),
        w=tuple(rng.uniform(0.5, 2) for _ in range(n)),
        act_bytes=(1.0,) * n,
        out_bytes=(0.0,) * n,
        static_bytes=(0.0,) * n,
    )
    m = 6
    sched = list_schedule(
        costs, placement, m, ListPolicy(extra_inflight=1, split_backward=split_backward), partition=partition
    )
    xs, ys = decoder_data(m, seed=3)
    n_blocks = sum(partition) - 2
    ref = reference_grads(n_blocks, xs, ys)
    layers = decoder(n_blocks)
    run_pipeline(sched, layers, xs, ys, lm_loss)
    assert max_rel_diff(layers, ref) <= 1e-6


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("name,make", ANCHOR_CASES, ids=[c[0] for c in ANCHOR_CASES])
def test_sleep_harness_gradients_exact(name, make, num_ranks):
    m = 2 * num_ranks
    sched = make(num_ranks, m)
    n = sched.num_stages + 2
    sched = with_partition(sched, uniform(n, sched.num_stages))
    costs = LayerCosts(
        f=(0.0,) * n,
        i=(0.0,) * n,
        w=(0.0,) * n,
        act_bytes=(1.0,) * n,
        out_bytes=(1.0,) * n,
        static_bytes=(1.0,) * n,
    )
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 16, generator=g) for _ in range(m)]
    ys = [torch.randn(2, 16, generator=g) for _ in range(m)]

    def mse(out, t):
        return ((out - t) ** 2).mean()

    ref_layers = sleep_layers(costs)
    model = torch.nn.Sequential(*ref_layers)
    for x, y in zip(xs, ys, strict=True):
        (mse(model(x), y) / m).backward()
    ref = [p.grad.clone() for layer in ref_layers for p in layer.parameters()]
    layers = sleep_layers(costs)
    run_pipeline(sched, layers, xs, ys, mse)
    assert max_rel_diff(layers, ref) <= 1e-6


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hf_decoder_pipeline_exact(kind):
    transformers = pytest.importorskip("transformers")
    from steptune.pipeline.stages import hf_decoder_layers

    def build():
        cfg_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[kind]
        cfg = cfg_cls(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    m = 4
    xs, ys = decoder_data(m, seed=1)
    ref_model = build()
    for x, y in zip(xs, ys, strict=True):
        (lm_loss(ref_model(input_ids=x).logits, y) / m).backward()
    ref = [p.grad.clone() for p in ref_model.parameters()]
    model = build()
    units = hf_decoder_layers(model)  # embed, 3 decoder layers, norm + head
    sched = with_partition(anchors.zb_v(2, m), (1, 1, 2, 1))
    run_pipeline(sched, units, xs, ys, lm_loss)
    got = [p.grad for p in model.parameters()]
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref, strict=True)) <= 1e-6


def test_hf_llama_with_a_vocab_sharded_head_matches_the_whole_model():
    # The tuner's head split on a real HF model: the head as 2 vocabulary shards on different ranks.
    transformers = pytest.importorskip("transformers")
    from steptune.pipeline.stages import hf_decoder_layers
    from steptune.pipeline.vocab_head import pack_targets, sharded_lm_loss

    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    m = 2
    xs, ys = decoder_data(m, seed=3)
    ref_model = build()
    for x, y in zip(xs, ys, strict=True):
        (lm_loss(ref_model(input_ids=x).logits, y) / m).backward()
    model = build()
    units = hf_decoder_layers(model, head_shards=2)  # embed, 2 decoder layers, 2 head shards
    packed = [pack_targets(x, y) for x, y in zip(xs, ys, strict=True)]
    run_pipeline(with_partition(anchors.one_f_one_b(2, m), (3, 2)), units, packed, ys, sharded_lm_loss)
    head_grad = torch.cat([u.weight.grad for u in units[-2:]])
    torch.testing.assert_close(head_grad, ref_model.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if not name.startswith("lm_head"):  # the shards hold the head's rows (checked above)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_200_random_valid_schedules_run_without_deadlock():
    rng = random.Random(2026)
    by_world: dict[int, list] = {2: [], 3: [], 4: []}
    for _ in range(200):
        p = rng.choice((2, 3, 4))
        n = rng.randrange(p, 7)
        sched = random_schedule(rng, num_devices=p, num_stages=n, num_microbatches=rng.choice((1, 2, 3, 5)))
        by_world[p].append(with_partition(sched, [1] * n))
    zero = LayerCosts(
        f=(0.0,) * 6,
        i=(0.0,) * 6,
        w=(0.0,) * 6,
        act_bytes=(1.0,) * 6,
        out_bytes=(1.0,) * 6,
        static_bytes=(1.0,) * 6,
    )

    def loss(o, t):
        return (o * t).sum()

    t0 = time.monotonic()
    for world, schedules in by_world.items():
        built = []
        for sched in schedules:  # models built outside the ranks: every rank sees the same stages
            stages = split_layers(sleep_layers(zero)[: sched.num_stages], sched.partition)
            xs = [torch.randn(1, 16) for _ in range(sched.num_microbatches)]
            built.append((sched, stages, xs))

        def rank_fn(rank, group, built=built):
            done = 0
            for sched, stages, xs in built:  # one gloo world runs every schedule of this size
                mine = {s: stages[s] for s in sched.stages_of(rank)}
                ex = PipelineExecutor(
                    sched,
                    mine,
                    rank=rank,
                    group=group,
                    boundary=[((1, 16), torch.float32)] * 6,
                    loss_fn=loss,
                    config=ExecutorConfig(timeout=20.0),
                )
                ex.step(xs if 0 in mine else None, xs if sched.num_stages - 1 in mine else None)
                done += 1
            return done

        assert run_threads(rank_fn, world, timeout=120) == [len(schedules)] * world
    assert sum(len(v) for v in by_world.values()) == 200
    assert time.monotonic() - t0 < 120


def test_invalid_schedules_refused_before_any_communication():
    refused = 0
    for kind, sched in invalid_schedules(random.Random(5), 20):
        with pytest.raises(ScheduleError) as info:
            # No group exists: a refusal here cannot have communicated.
            PipelineExecutor(sched, {}, rank=0, group=None, boundary=[], loss_fn=lm_loss)
        msg = str(info.value)
        assert any(
            word in msg for word in ("deadlocks", "missing", "twice", "placed on", "needs exactly one")
        )
        if kind in ("cycle", "backward_first"):
            assert "deadlocks" in msg and "->" in msg
        refused += 1
    assert refused == 20
    check_schedule(anchors.zb_v(4, 8))  # and a valid one passes


def _sleep_stages(f, partition):
    """Sleep layers (``f[k]`` seconds in unit k's forward, nothing else), split by ``partition``."""
    n = len(f)
    costs = LayerCosts(f=tuple(f), i=(0.0,) * n, w=(0.0,) * n, act_bytes=(1.0,) * n, out_bytes=(1.0,) * n,
                       static_bytes=(1.0,) * n)  # fmt: skip
    return split_layers(sleep_layers(costs), partition)


def _watched(sched, stages, rank, group, store, **config):
    """An executor with a 1 s watchdog that publishes positions in ``store``."""
    return PipelineExecutor(sched, {rank: stages[rank]}, rank=rank, group=group,
                            boundary=[((1, 16), torch.float32)] * (sched.num_stages - 1),
                            loss_fn=lambda o, t: o.sum(), config=ExecutorConfig(timeout=1.0, **config),
                            store=store, prefix="pp")  # fmt: skip


def test_stuck_rank_becomes_an_error_with_every_rank_position():
    from steptune.core.dist import master_store

    sched = with_partition(anchors.one_f_one_b(2, 2), (2, 2))
    stages = _sleep_stages((0.0,) * 4, (2, 2))
    xs = [torch.randn(1, 16) for _ in range(2)]
    store = master_store()

    def rank_fn(rank, group):
        ex = _watched(sched, stages, rank, group, store)
        if rank == 1:
            store.set("pp/pos/1", "stuck before its first action (injected)")
            time.sleep(3.0)  # a dead-slow rank: rank 0 must not wait forever
            return None
        return ex.step(xs, None)

    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_threads(rank_fn, 2, timeout=30)
    assert time.monotonic() - t0 < 10
    msg = info.value.remote_traceback
    assert "ExecutorTimeout" in msg and "rank 0: action" in msg and "rank 1: stuck before" in msg


def test_on_timeout_publishing_names_the_waiting_ranks_and_the_busy_one():
    """``publish="timeout"`` (what ``pipeline run`` uses: no store call per timed action): the ranks whose
    waits time out publish then and list each other; the rank stuck computing is the one unpublished."""
    from steptune.core.dist import connect_store, master_store

    sched = with_partition(anchors.one_f_one_b(3, 2), (1, 1, 1))
    # rank 0 computes past its peers' 1 s watchdog and their 1 s grace
    stages = _sleep_stages((4.0, 0.0, 0.0), (1, 1, 1))
    store = master_store()

    def rank_fn(rank, group):
        # one store client per rank, as processes have: a client is not threadsafe
        ex = _watched(sched, stages, rank, group, connect_store(store.port), publish="timeout")
        return ex.step([torch.randn(1, 16) for _ in range(2)] if rank == 0 else None, [None, None])

    with pytest.raises(RankFailure) as info:
        run_threads(rank_fn, 3, timeout=30)
    msg = info.value.remote_traceback
    assert "ExecutorTimeout" in msg
    assert "rank 0: (no position published within 1 s: busy, hung or dead?)" in msg
    assert "rank 1: action 0/" in msg and "rank 2: action 0/" in msg
    with pytest.raises(ValueError, match="publish"):
        ExecutorConfig(publish="never")


def test_a_ragged_microbatch_is_refused_before_any_communication():
    # Found in a sweep (2026-12-05): the short last microbatch went out, the next stage received it into a
    # buffer sized for microbatch 0 and computed on uninitialised memory before failing far away
    sched = with_partition(ANCHOR_CASES[0][1](2, 4), uniform(4, 2))
    xs, ys = decoder_data(4)
    xs[3], ys[3] = xs[3][:1], ys[3][:1]
    with pytest.raises(RankFailure, match=r"microbatch 3's output at the boundary to stage 1"):
        run_pipeline(sched, decoder(2), xs, ys, lm_loss, timeout=2.0)


def _shared_units():
    torch.manual_seed(0)
    shared = torch.nn.Linear(8, 8)
    return [torch.nn.Linear(8, 8), shared, torch.nn.Sequential(torch.nn.Tanh(), shared),
            torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]  # fmt: skip


@pytest.mark.parametrize("make", [anchors.one_f_one_b, anchors.zb_h1], ids=["1f1b", "zb_h1"])
def test_a_parameter_two_units_of_a_stage_share_gets_its_gradient_once(make):
    # A sweep: shared.weight's gradient was 0.095 off (of 0.148): W of the later unit walks back through
    # the earlier one, and W of the earlier one added its use again
    import copy

    units = _shared_units()
    ref = torch.nn.Sequential(*copy.deepcopy(units))
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    ys = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + k)) for k in range(2)]
    mse = lambda o, t: ((o - t) ** 2).mean()  # noqa: E731
    for x, y in zip(xs, ys, strict=True):
        (mse(ref(x), y) / 2).backward()
    run_pipeline(with_partition(make(2, 2), (3, 2)), units, xs, ys, mse)
    got = {id(p): p.grad for u in units for p in u.parameters()}
    want = [p.grad for u in ref for p in u.parameters()]
    pairs = list(zip([p for u in units for p in u.parameters()], want, strict=True))
    assert max((got[id(p)] - w).abs().max().item() for p, w in pairs) <= 1e-6


def test_boundary_dtype_tuples_and_misfiled_stages_are_refused_with_what_to_do():
    # A sweep: a bf16 output into a float32 buffer gave wrong losses silently; a tuple output or a dict
    # microbatch an AttributeError mid-step; stage 1's module under key 0 ran the wrong model
    sched = with_partition(anchors.one_f_one_b(2, 2), (1, 1))
    stages = split_layers([torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 8)], (1, 1))
    xs = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(2)]

    def rank0(boundary, inputs):
        def fn(rank, group):
            if rank == 1:
                return None
            ex = PipelineExecutor(sched, {0: stages[0]}, rank=0, group=group, boundary=boundary,
                                  loss_fn=lm_loss, config=ExecutorConfig(timeout=2.0))  # fmt: skip
            return ex.step(inputs, None)

        with pytest.raises(RankFailure) as info:
            run_threads(fn, 2, timeout=30)
        return info.value.remote_traceback

    msg = rank0([((3, 8), torch.float32)], xs)
    assert "TypeError" in msg and "is torch.bfloat16, the boundary's is torch.float32" in msg
    msg = rank0([((3, 8), torch.bfloat16)], [{"x": x} for x in xs])
    assert "TypeError: microbatch 0 is a dict" in msg
    with pytest.raises(TypeError, match=r"unit 0 \(Pair\) returns a tuple"):

        class Pair(torch.nn.Module):
            def forward(self, x):
                return x, x

        boundary_shape([Pair()], torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"is stage 1 \(Stage.index\)"):
        PipelineExecutor(sched, {0: stages[1]}, rank=0, group=None, boundary=[((3, 8), torch.float32)],
                         loss_fn=lm_loss)  # fmt: skip
