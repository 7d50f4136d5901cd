"""Where a fork's prefix KV comes from, as a cost model: the serving engine's cache, a remote tier, prefill.

Contract: pure and clock-free (every call carries `now`, unused by these LRU tiers); no real bytes move here.
A tier answers one question for the orchestrator, "how many seconds until a fork can decode from this
prefix?", and keeps the books in `KVStats`.
Prefix identity: a prefix is named by the stream that produced it (`prefix_id`, e.g. the main reasoning
stream's id) and a length in tokens. Within a stream a longer prefix contains every shorter one, so entries
are keyed by (stream, tokens) with only the longest resident length t kept per stream: a lookup for T <= t
tokens is a hit, one for T > t a partial hit that prefills only T - t tokens. `lookup` never inserts what it
prefills: call `put` once the main stream or the fork has computed the blocks (a fork's own tokens after the
prefix belong to the fork's id, should anyone fork from it). A lookup refreshes the stream's LRU position,
and `SimTier.lookup` copies what it fetched from the remote tier into the local cache.
Approximations: eviction is LRU over whole streams (engines evict 16-64-token blocks, tails first); a
transfer costs one setup latency plus bytes / link bandwidth, with no contention between concurrent forks;
write-backs to the remote tier are off the critical path (their bytes are counted, their time is not);
prefill runs at one average throughput, so the quadratic attention term of long prefixes is folded into
`prefill_tps`. Every default in `KVCostModel` is an assumption, not a measurement.
Launch settings for real tiers (LMCache, Mooncake Store, SGLang HiCache) are emitted by `kvconfig.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFAULT_LOCAL_CAPACITY_TOKENS",
    "KVCostModel",
    "KVStats",
    "KVTier",
    "LocalCache",
    "NullTier",
    "SimTier",
]

DEFAULT_LOCAL_CAPACITY_TOKENS = 400_000
"""Serving-engine prefix cache, an assumption: DeepSeek-V3-class FP8 weights on 8xH200 (TP8) leave ~30 GB of
KV per GPU at 0.9 memory utilization, and TP ranks replicate MLA latents: 30e9 / 70,272 B ≈ 427k tokens."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCostModel:
    """What moving or recomputing prefix KV costs (H200-class defaults, all assumptions)."""

    kv_bytes_per_token: int = 70_272
    """KV bytes per token, one copy. Default: DeepSeek-V3-class MLA, 61 layers x (512 latent + 64 RoPE-key
    dims) x 2 bytes = 70,272 B (config.json: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64).
    GQA for comparison: GLM-4.5, 92 layers x 2 (K, V) x 8 KV heads x 128 head_dim x 2 bytes = 376,832 B."""
    prefill_tps: float = 15_000.0
    """Tokens/s to recompute a prefix on the serving GPUs. Assumption: 10k-20k tok/s for one long prefix of a
    large MoE on 8xH200 (FP8); measure it on the real deployment."""
    link_gbps: float = 400.0
    """Serving-to-evaluation link in gigabits/s (not bytes). Default: one 400 Gb/s InfiniBand/RoCE NIC per
    GPU with GPUDirect RDMA, 50 GB/s line rate; PCIe 5.0 x16 moves ~50 GB/s in practice, about the same."""
    setup_s: float = 0.002
    """Per-transfer latency (lookup, registration, first byte), an assumption."""

    def __post_init__(self) -> None:
        for name, low in (
            ("kv_bytes_per_token", 1),
            ("prefill_tps", 1e-9),
            ("link_gbps", 1e-9),
            ("setup_s", 0),
        ):
            if not getattr(self, name) >= low:
                raise ValueError(f"{name}={getattr(self, name)}: pass a number >= {low}")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tps

    def transfer_s(self, tokens: int) -> float:
        return self.setup_s + tokens * self.kv_bytes_per_token / self.link_bytes_per_s if tokens else 0.0


@dataclass(slots=True)
class KVStats:
    """Counters since the tier was made. A lookup is a hit (nothing prefilled), a partial hit or a miss."""

    lookups: int = 0
    hits: int = 0
    partial_hits: int = 0
    misses: int = 0
    remote_hits: int = 0
    """Lookups that fetched some tokens from the remote tier."""
    evictions: int = 0
    """Streams dropped from the tier altogether (demotion to the remote tier is not an eviction)."""
    bytes_moved: int = 0
    """Over the link: remote fetches plus write-backs."""
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    prefill_s_saved: float = 0.0
    """Prefill seconds of the same lookups with no cache at all, minus the seconds they cost."""


class KVTier(Protocol):
    """The orchestrator's view of a KV tier."""

    @property
    def stats(self) -> KVStats: ...

    def lookup(self, prefix_id: str, tokens: int, now: float) -> float:
        """Seconds to make the first `tokens` tokens of `prefix_id` available to a fork (0 when resident)."""
        ...

    def put(self, prefix_id: str, tokens: int, now: float) -> None:
        """Record that the first `tokens` tokens of `prefix_id` have been computed on the serving GPUs."""
        ...

    def replica(self) -> KVTier:
        """The tier as another data-parallel serving replica sees it (its own engine cache)."""
        ...


class _Lru:
    """Longest resident length per stream, least recently used first, at most `capacity` tokens in all."""

    __slots__ = ("capacity", "entries", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used = 0

    def resident(self, stream: str) -> int:
        return self.entries.get(stream, 0)

    def touch(self, stream: str) -> None:
        if stream in self.entries:
            self.entries.move_to_end(stream)

    def insert(self, stream: str, tokens: int) -> list[tuple[str, int]]:
        """Keep at least min(tokens, capacity) tokens of `stream`, most recent; return the evicted entries."""
        tokens = min(tokens, self.capacity)
        old = self.entries.get(stream, 0)
        self.touch(stream)
        if tokens <= old:
            return []
        self.entries[stream] = tokens
        self.entries.move_to_end(stream)
        self.used += tokens - old
        evicted = []
        while self.used > self.capacity:
            victim = self.entries.popitem(last=False)
            self.used -= victim[1]
            evicted.append(victim)
        return evicted


def _check(prefix_id: str, tokens: int) -> None:
    if not isinstance(prefix_id, str) or not prefix_id:
        raise ValueError(f"prefix_id={prefix_id!r}: pass the producing stream's id as a non-empty string")
    _tokens("tokens", tokens)


def _tokens(name: str, tokens: int) -> int:
    if tokens < 0:
        raise ValueError(f"{name}={tokens}: pass a number of tokens (0 or more)")
    return int(tokens)


class LocalCache:
    """The serving engine's own prefix cache (vLLM APC, SGLang radix cache): LRU, `capacity_tokens` in all.
    A hit costs 0, a partial hit prefills the missing tail, a miss prefills everything; evictions are lost.
    A prefix longer than the whole cache keeps its first `capacity_tokens` tokens."""

    def __init__(
        self, capacity_tokens: int = DEFAULT_LOCAL_CAPACITY_TOKENS, cost: KVCostModel | None = None
    ) -> None:
        self.cost = cost or KVCostModel()
        self._local = _Lru(_tokens("capacity_tokens", capacity_tokens))
        self._stats = KVStats()

    @property
    def stats(self) -> KVStats:
        return self._stats

    @property
    def capacity_tokens(self) -> int:
        return self._local.capacity

    def replica(self) -> LocalCache:
        """Another serving replica's cache: same kind, capacity and costs, empty, nothing shared."""
        return type(self)(self.capacity_tokens, self.cost)

    def resident(self, prefix_id: str) -> int:
        """Tokens of `prefix_id` in the serving engine's cache (does not refresh its LRU position)."""
        return self._local.resident(prefix_id)

    def lookup(self, prefix_id: str, tokens: int, now: float) -> float:
        _check(prefix_id, tokens)
        have = min(self._local.resident(prefix_id), tokens)
        self._local.touch(prefix_id)
        return self._account(tokens, prefill=tokens - have, fetched=0)

    def put(self, prefix_id: str, tokens: int, now: float) -> None:
        _check(prefix_id, tokens)
        for stream, held in self._local.insert(prefix_id, tokens):
            self._demote(stream, held)

    def _demote(self, stream: str, tokens: int) -> None:
        self._stats.evictions += 1

    def _account(self, tokens: int, *, prefill: int, fetched: int) -> float:
        s, cost = self._stats, self.cost
        seconds = cost.transfer_s(fetched) + cost.prefill_s(prefill)
        s.lookups += 1
        if prefill == 0:
            s.hits += 1
        elif prefill < tokens:
            s.partial_hits += 1
        else:
            s.misses += 1
        if fetched:
            s.remote_hits += 1
            s.bytes_moved += fetched * cost.kv_bytes_per_token
            s.transfer_s += cost.transfer_s(fetched)
        s.prefill_tokens += prefill
        s.prefill_s += cost.prefill_s(prefill)
        s.prefill_s_saved += cost.prefill_s(tokens) - seconds
        return seconds


class NullTier(LocalCache):
    """The "no KV tier" ablation: the serving engine's prefix cache and nothing behind it."""


class SimTier(LocalCache):
    """The serving engine's cache in front of a remote tier in spare evaluation-GPU memory, both LRU.
    Local hit: 0 s. Remote hit: `setup_s` + bytes / link, and the blocks are copied back into the local cache
    (the remote keeps its copy). Miss: prefill. Streams evicted locally are written back to the remote tier
    (with `write_through`, every put is stored there at once), which drops its own LRU streams when full;
    with remote capacity 0 this is exactly `NullTier`. A remote segment is fetched only when that beats
    prefilling it (tiny tails cost more in setup_s)."""

    def __init__(
        self,
        remote_capacity_tokens: int,
        *,
        local_capacity_tokens: int = DEFAULT_LOCAL_CAPACITY_TOKENS,
        cost: KVCostModel | None = None,
        write_through: bool = False,
    ) -> None:
        super().__init__(local_capacity_tokens, cost)
        self._remote = _Lru(_tokens("remote_capacity_tokens", remote_capacity_tokens))
        self.write_through = write_through
        """Also store every `put` in the remote tier as the engine computes it (LMCache's store-on-compute,
        HiCache's write_through), so that another serving replica can fetch it; otherwise streams reach the
        remote tier only when the local cache evicts them."""

    def replica(self) -> SimTier:
        """Another serving replica's tier: its own engine cache (same capacity, empty), this remote tier.
        Data-parallel replicas do not share engine caches, so a fork routed away from its reasoning stream's
        replica finds its prefix only in the shared remote tier (with `write_through`) or prefills it."""
        twin = SimTier(
            0,
            local_capacity_tokens=self.capacity_tokens,
            cost=self.cost,
            write_through=self.write_through,
        )
        twin._remote = self._remote
        return twin

    @classmethod
    def from_eval_gpus(
        cls,
        num_gpus: int,
        spare_gib_per_gpu: float,
        cost: KVCostModel | None = None,
        *,
        local_capacity_tokens: int = DEFAULT_LOCAL_CAPACITY_TOKENS,
        write_through: bool = False,
    ) -> SimTier:
        """Remote capacity = num_gpus x spare GiB / kv_bytes_per_token, e.g. 8 H200s lending 100 GiB each hold
        8 x 100 x 2**30 / 70,272 B = 12.2M tokens, about 400 prefixes of 30k tokens."""
        if num_gpus < 0 or not spare_gib_per_gpu >= 0:
            raise ValueError(f"num_gpus={num_gpus}, spare_gib_per_gpu={spare_gib_per_gpu}: pass 0 or more")
        model = cost or KVCostModel()
        tokens = int(num_gpus * spare_gib_per_gpu * 2**30 // model.kv_bytes_per_token)
        return cls(
            tokens, local_capacity_tokens=local_capacity_tokens, cost=model, write_through=write_through
        )

    @property
    def remote_capacity_tokens(self) -> int:
        return self._remote.capacity

    def remote_resident(self, prefix_id: str) -> int:
        """Tokens of `prefix_id` held by the remote tier (does not refresh its LRU position)."""
        return self._remote.resident(prefix_id)

    def lookup(self, prefix_id: str, tokens: int, now: float) -> float:
        _check(prefix_id, tokens)
        local = min(self._local.resident(prefix_id), tokens)
        fetched = max(0, min(self._remote.resident(prefix_id), tokens) - local)
        if fetched and self.cost.transfer_s(fetched) >= self.cost.prefill_s(fetched):
            fetched = 0
        self._local.touch(prefix_id)
        seconds = self._account(tokens, prefill=tokens - local - fetched, fetched=fetched)
        if fetched:
            self._remote.touch(prefix_id)
            self.put(prefix_id, local + fetched, now)
        return seconds

    def put(self, prefix_id: str, tokens: int, now: float) -> None:
        super().put(prefix_id, tokens, now)
        if self.write_through and self._remote.capacity:
            self._demote(prefix_id, tokens)

    def _demote(self, stream: str, tokens: int) -> None:
        kept = min(tokens, self._remote.capacity)
        new = kept - self._remote.resident(stream)
        if new > 0:
            self._stats.bytes_moved += new * self.cost.kv_bytes_per_token
        self._stats.evictions += len(self._remote.insert(stream, tokens)) + (kept == 0)
