"""KV tiers as exact cost models: LRU order, partial prefix hits, remote hits that are cheap but not free,
a zero-capacity remote tier that behaves exactly like no tier, the spare-memory arithmetic, and launch
settings for LMCache, Mooncake Store and SGLang HiCache that parse and carry the documented keys and flags."""

import dataclasses
import json
import random

import pytest

from steptune.kernels.kvconfig import (
    lmcache_config,
    lmcache_env,
    lmcache_vllm_args,
    mooncake_store_config,
    mooncake_store_vllm_args,
    sglang_hicache_args,
    vllm_kv_transfer_args,
)
from steptune.kernels.kvtier import KVCostModel, KVTier, LocalCache, NullTier, SimTier

pytestmark = pytest.mark.timeout(60)

COST = KVCostModel()


def test_default_cost_model_arithmetic():
    assert COST.kv_bytes_per_token == 61 * (512 + 64) * 2  # DeepSeek-V3-class MLA latent + RoPE key, bf16
    assert COST.link_bytes_per_s == 50e9  # 400 Gb/s
    assert COST.transfer_s(30_000) == pytest.approx(0.002 + 30_000 * 70_272 / 50e9)  # ≈ 44 ms
    assert COST.prefill_s(30_000) == pytest.approx(2.0)
    assert COST.transfer_s(0) == 0.0
    with pytest.raises(ValueError, match="link_gbps"):
        KVCostModel(link_gbps=0.0)


def test_lru_evicts_the_least_recently_used_stream():
    cache = LocalCache(100)
    cache.put("a", 40, 0.0)
    cache.put("b", 40, 1.0)
    assert cache.lookup("a", 40, 2.0) == 0.0  # a is now the most recent
    cache.put("c", 40, 3.0)  # 120 > 100: b goes
    assert (cache.resident("a"), cache.resident("b"), cache.resident("c")) == (40, 0, 40)
    assert cache.stats.evictions == 1
    assert cache.lookup("b", 40, 4.0) == pytest.approx(COST.prefill_s(40))


def test_a_longer_prefix_supersedes_a_shorter_one_and_partial_hits_prefill_the_tail():
    cache = LocalCache(10_000)
    cache.put("main", 1_000, 0.0)
    cache.put("main", 3_000, 1.0)
    cache.put("main", 2_000, 2.0)  # already covered
    assert cache.resident("main") == 3_000
    assert cache.lookup("main", 2_500, 3.0) == 0.0
    assert cache.lookup("main", 5_000, 4.0) == pytest.approx(COST.prefill_s(2_000))
    assert cache.lookup("other", 1_000, 5.0) == pytest.approx(COST.prefill_s(1_000))
    s = cache.stats
    assert (s.lookups, s.hits, s.partial_hits, s.misses) == (3, 1, 1, 1)
    assert s.prefill_tokens == 3_000
    assert s.prefill_s_saved == pytest.approx(COST.prefill_s(2_500 + 3_000))


def test_a_prefix_larger_than_the_cache_keeps_its_head():
    cache = LocalCache(1_000)
    assert cache.capacity_tokens == 1_000
    cache.put("x", 100, 0.0)
    cache.put("main", 5_000, 1.0)
    assert (cache.resident("main"), cache.resident("x")) == (1_000, 0)
    assert cache.lookup("main", 5_000, 2.0) == pytest.approx(COST.prefill_s(4_000))


def test_remote_hits_are_cheaper_than_prefill_but_not_free():
    tier = SimTier(100_000, local_capacity_tokens=30_000)
    tier.put("old", 30_000, 0.0)
    tier.put("new", 30_000, 1.0)  # "old" is written back to the remote tier
    assert (tier.resident("old"), tier.remote_resident("old")) == (0, 30_000)
    seconds = tier.lookup("old", 30_000, 2.0)
    assert seconds == pytest.approx(COST.transfer_s(30_000))
    assert 0.0 < seconds < COST.prefill_s(30_000) / 10
    assert tier.resident("old") == 30_000  # promoted; "new" went to the remote tier in turn
    assert tier.remote_resident("new") == 30_000
    assert tier.lookup("old", 30_000, 3.0) == 0.0
    s = tier.stats
    assert (s.hits, s.remote_hits, s.misses, s.evictions) == (2, 1, 0, 0)
    assert s.bytes_moved == 3 * 30_000 * COST.kv_bytes_per_token  # write-back, fetch, write-back
    assert s.transfer_s == pytest.approx(seconds)
    assert s.prefill_s_saved == pytest.approx(2 * COST.prefill_s(30_000) - seconds)


def test_replicas_share_the_remote_tier_only_with_write_through():
    # data-parallel replicas do not share engine caches: a fork on another replica finds its stream's prefix
    # only in a shared tier that the first replica wrote through to as it computed
    a = SimTier(100_000, local_capacity_tokens=50_000, write_through=True)
    b = a.replica()
    a.put("main", 20_000, 0.0)
    assert (a.resident("main"), b.resident("main"), b.remote_resident("main")) == (20_000, 0, 20_000)
    assert b.lookup("main", 12_000, 1.0) == pytest.approx(COST.transfer_s(12_000))
    assert b.resident("main") == 12_000 and b.lookup("main", 12_000, 2.0) == 0.0
    lazy = SimTier(100_000, local_capacity_tokens=50_000)  # write-back on eviction only
    lazy.put("main", 20_000, 0.0)
    assert lazy.replica().lookup("main", 12_000, 1.0) == pytest.approx(COST.prefill_s(12_000))
    none = NullTier(50_000)
    none.put("main", 20_000, 0.0)
    assert isinstance(none.replica(), NullTier)
    assert none.replica().lookup("main", 12_000, 1.0) == pytest.approx(COST.prefill_s(12_000))


def test_remote_segments_combine_with_local_and_prefill():
    tier = SimTier(100_000, local_capacity_tokens=10_000)
    tier.put("main", 8_000, 0.0)
    tier.put("other", 10_000, 1.0)  # main (8k) goes remote
    tier.put("main", 4_000, 2.0)  # a shorter local copy: remote keeps the longer one
    assert (tier.resident("main"), tier.remote_resident("main")) == (4_000, 8_000)
    seconds = tier.lookup("main", 9_000, 3.0)
    assert seconds == pytest.approx(COST.transfer_s(4_000) + COST.prefill_s(1_000))
    assert tier.stats.partial_hits == 1


def test_tiny_remote_segments_are_prefilled_when_setup_dominates():
    slow_setup = KVCostModel(setup_s=1.0)
    tier = SimTier(1_000, local_capacity_tokens=100, cost=slow_setup)
    tier.put("a", 100, 0.0)
    tier.put("b", 100, 1.0)
    assert tier.lookup("a", 100, 2.0) == pytest.approx(slow_setup.prefill_s(100))
    assert tier.stats.remote_hits == 0


def _replay(tier, seed):
    rng = random.Random(seed)
    costs = []
    for step in range(2_000):
        stream = f"s{rng.randrange(12)}"
        tokens = rng.randrange(0, 40_000)
        if rng.random() < 0.5:
            tier.put(stream, tokens, float(step))
        else:
            costs.append(tier.lookup(stream, tokens, float(step)))
    return costs


@pytest.mark.parametrize("seed", [0, 1])
def test_zero_remote_capacity_is_exactly_no_tier(seed):
    null, sim = NullTier(100_000), SimTier(0, local_capacity_tokens=100_000)
    assert _replay(sim, seed) == _replay(null, seed)
    assert dataclasses.asdict(sim.stats) == dataclasses.asdict(null.stats)
    assert null.stats.evictions > 0 and null.stats.partial_hits > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_remote_tier_saves_prefill(seed):
    null = NullTier(100_000)
    sim = SimTier.from_eval_gpus(1, 10.0, local_capacity_tokens=100_000)
    assert sum(_replay(sim, seed)) < 0.8 * sum(_replay(null, seed))
    assert sim.stats.prefill_s_saved > null.stats.prefill_s_saved
    assert sim.stats.remote_hits > 0


def test_from_eval_gpus_arithmetic():
    tier = SimTier.from_eval_gpus(8, 100.0)
    assert tier.remote_resident("nothing") == 0
    assert tier.remote_capacity_tokens == 8 * 100 * 2**30 // 70_272 == 12_223_836
    small = SimTier.from_eval_gpus(2, 1.5, KVCostModel(kv_bytes_per_token=1024))
    assert small.remote_capacity_tokens == 2 * 1.5 * 2**30 // 1024
    assert SimTier.from_eval_gpus(0, 100.0).remote_capacity_tokens == 0


def test_tiers_satisfy_the_protocol():
    tiers: list[KVTier] = [LocalCache(), NullTier(), SimTier(1_000)]
    for tier in tiers:
        assert tier.lookup("p", 10, 0.0) > 0.0
        tier.put("p", 10, 0.0)
        assert tier.lookup("p", 10, 1.0) == 0.0
        assert tier.stats.lookups == 2


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: LocalCache(-1), "capacity_tokens=-1"),
        (lambda: SimTier(-5), "remote_capacity_tokens=-5"),
        (lambda: LocalCache().lookup("", 10, 0.0), "non-empty"),
        (lambda: LocalCache().put("p", -1, 0.0), "tokens=-1"),
        (lambda: SimTier.from_eval_gpus(-1, 10.0), "0 or more"),
    ],
)
def test_bad_input_says_what_to_change(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_vllm_flags_carry_connector_json():
    flag, payload = lmcache_vllm_args()
    assert flag == "--kv-transfer-config"
    assert payload == '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
    assert json.loads(mooncake_store_vllm_args()[1]) == {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
    }
    assert json.loads(vllm_kv_transfer_args("X", "kv_consumer")[1])["kv_role"] == "kv_consumer"
    with pytest.raises(ValueError, match="kv_both"):
        vllm_kv_transfer_args("X", "both")


def test_lmcache_config_and_env():
    config = lmcache_config()
    assert config == {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 5.0, "use_layerwise": False}
    remote = lmcache_config(remote_url="lm://eval-0:65432", local_cpu=False)
    assert remote["remote_url"] == "lm://eval-0:65432"
    assert json.loads(json.dumps(remote)) == remote  # YAML- and JSON-able plain values
    env = lmcache_env(config)
    assert env["LMCACHE_CHUNK_SIZE"] == "256"
    assert env["LMCACHE_LOCAL_CPU"] == "True"
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "5.0"
    with pytest.raises(ValueError, match="chunk_size=0"):
        lmcache_config(chunk_size=0)


def test_mooncake_store_config():
    config = mooncake_store_config("10.0.0.1:50051", "100GB", protocol="tcp")
    assert json.loads(json.dumps(config)) == {
        "mode": "embedded",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": "10.0.0.1:50051",
        "global_segment_size": "100GB",
        "local_buffer_size": "4GB",
        "protocol": "tcp",
        "device_name": "",
    }
    with pytest.raises(ValueError, match="'rdma'"):
        mooncake_store_config("10.0.0.1:50051", protocol="ib")
    with pytest.raises(ValueError, match="host:port"):
        mooncake_store_config("10.0.0.1")


def test_sglang_hicache_args():
    args = sglang_hicache_args(storage_backend="mooncake")
    assert args == [
        "--enable-hierarchical-cache",
        "--page-size",
        "64",
        "--hicache-ratio",
        "2",
        "--hicache-write-policy",
        "write_through",
        "--hicache-io-backend",
        "kernel",
        "--hicache-mem-layout",
        "page_first",
        "--hicache-storage-backend",
        "mooncake",
    ]
    sized = sglang_hicache_args(hicache_size_gb=100)
    assert "--hicache-ratio" not in sized
    assert sized[sized.index("--hicache-size") + 1] == "100"
    assert "--hicache-storage-backend" not in sized
    with pytest.raises(ValueError, match="page_size=0"):
        sglang_hicache_args(page_size=0)
