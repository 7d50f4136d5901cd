"""Communication costs of a simulated plan, and link fail-slows. SIMULATED (alpha-beta model).

With ``SimJob(comm=True)`` a step pays, per microbatch and stage:
- TP: Megatron's two all-reduces of each decoder layer's output in the forward and two in the backward,
  ring over the group's k devices: ``2(k-1)/k x bytes / bw + 2(k-1) x latency`` (0 for k = 1), NVLink
  when the group sits in one node, else the per-GPU IB share.
- PP: the microbatch's activation to the next stage (forward) and its gradient back (backward), split
  into max(k_send, k_recv) chunks that cross in parallel (ResiHP's scatter/gather P2P between unequal
  TP degrees): ``latency + bytes / chunks / bw``, NVLink when both groups share a node.
Both are added to the stage's F and B times (Megatron's 1F1B waits for its sends), so they pace the
pipeline like compute but do not scale with the device's compute speed. After the flush:
- DP: a ring all-reduce of the bf16 gradients among the replicas, one ring per stage position, each
  device reducing its own share (stage layers' gradient bytes / k); the step waits for the slowest ring.
  Not overlapped with the backward.

Links: a "link" fail-slow multiplies the bandwidth of every transfer its device takes part in (a
congested NIC, a degraded NVLink); a transfer runs at its slowest participant's factor. A speed
vector of ``2n`` entries carries the ``n`` compute factors followed by the ``n`` link factors; one of
``n`` entries has healthy links.

Ignored: contention between transfers sharing a NIC or switch, overlap of TP collectives with
compute, the optimizer step, and the embedding's and head's vocabulary-parallel collectives.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from steptune.core.specs import LayerKind, LinkSpec, cluster_preset, model_preset

__all__ = ["CommModel", "comm_model", "effective_speeds"]

_GRAD_BYTES_PER_PARAM = 2.0
"""bf16 gradients on the wire."""
_TP_COLLECTIVES = {LayerKind.DECODER: 2, LayerKind.MOE_DECODER: 2, LayerKind.ATTENTION: 1, LayerKind.MLP: 1}
"""All-reduces per layer in each direction (Megatron's f/g operators)."""


@dataclass(frozen=True, kw_only=True)
class CommModel:
    num_devices: int
    gpus_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    act_bytes: tuple[float, ...]
    """Per layer: bytes of its output for one microbatch (the P2P payload after it)."""
    tp_calls: tuple[int, ...]
    """Per layer: TP all-reduces in each direction."""
    grad_bytes: tuple[float, ...]
    """Per layer: bytes of its gradients."""

    def __post_init__(self) -> None:
        # Prefix sums: O(1) per stage however many layers it holds.
        vol = (c * b for c, b in zip(self.tp_calls, self.act_bytes, strict=True))
        object.__setattr__(self, "_tp_vol", tuple(itertools.accumulate(vol, initial=0.0)))
        object.__setattr__(self, "_tp_n", tuple(itertools.accumulate(self.tp_calls, initial=0)))
        object.__setattr__(self, "_grad", tuple(itertools.accumulate(self.grad_bytes, initial=0.0)))
        object.__setattr__(self, "_memo", {})  # the step-time functions call these per candidate plan

    def _link_key(self, groups: Sequence[Sequence[int]], speeds: Sequence[float]) -> tuple[float, ...] | None:
        """The link factors of ``groups``' devices, or None when every one is healthy (the common case)."""
        if len(speeds) <= self.num_devices:
            return None
        n = self.num_devices
        key = tuple(speeds[n + d] for g in groups for d in g)
        return key if min(key) < 1.0 else None

    def slow_link(self, groups: Sequence[Sequence[int]], speeds: Sequence[float]) -> bool:
        """Whether ``speeds`` (compute, then link factors) shows a slow link on ``groups``' devices."""
        return self._link_key(groups, speeds) is not None

    def link(self, speeds: Sequence[float], d: int) -> float:
        return speeds[self.num_devices + d] if len(speeds) > self.num_devices else 1.0

    def _net(self, groups: Sequence[Sequence[int]], speeds: Sequence[float]) -> tuple[LinkSpec, float]:
        """The link level joining ``groups`` and their slowest member's link factor."""
        nodes = {d // self.gpus_per_node for g in groups for d in g}
        factor = min(self.link(speeds, d) for g in groups for d in g)
        return (self.intra if len(nodes) == 1 else self.inter), factor

    def tp_s(self, group: Sequence[int], start: int, count: int, speeds: Sequence[float]) -> float:
        """Seconds of TP all-reduces per microbatch in one direction for layers ``start:start+count``."""
        k = len(group)
        if k <= 1 or count <= 0:
            return 0.0
        net, factor = self._net((group,), speeds)
        if factor <= 0:
            return float("inf")
        vol = self._tp_vol[start + count] - self._tp_vol[start]
        calls = self._tp_n[start + count] - self._tp_n[start]
        return 2 * (k - 1) / k * vol / (net.bandwidth * factor) + 2 * (k - 1) * calls * net.latency

    def p2p_s(self, send: Sequence[int], recv: Sequence[int], layer: int, speeds: Sequence[float]) -> float:
        """Seconds to hand layer ``layer``'s output (or its gradient) between two stage groups."""
        net, factor = self._net((send, recv), speeds)
        if factor <= 0:
            return float("inf")
        chunks = max(len(send), len(recv))
        return net.latency + self.act_bytes[layer] / chunks / (net.bandwidth * factor)

    def stage_extra(
        self, groups: Sequence[Sequence[int]], part: Sequence[int], speeds: Sequence[float]
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per stage of one replica: seconds of communication added to its F and to its B."""
        memo_key = ("stage", tuple(groups), tuple(part), self._link_key(groups, speeds))
        if (hit := self._memo.get(memo_key)) is not None:
            return hit  # type: ignore[no-any-return]
        f, b, start = [], [], 0
        for s, (g, n) in enumerate(zip(groups, part, strict=True)):
            tp = self.tp_s(g, start, n, speeds)
            fwd = self.p2p_s(g, groups[s + 1], start + n - 1, speeds) if s + 1 < len(groups) else 0.0
            bwd = self.p2p_s(g, groups[s - 1], start - 1, speeds) if s > 0 else 0.0
            f.append(tp + fwd)
            b.append(tp + bwd)
            start += n
        out = (tuple(f), tuple(b))
        self._memo[memo_key] = out
        return out

    def dp_sync_s(
        self,
        groups: Sequence[Sequence[int]],
        partitions: Sequence[Sequence[int]],
        speeds: Sequence[float],
    ) -> float:
        """Gradient all-reduce after the flush: ``groups`` replica-major, one partition per replica."""
        num_r = len(partitions)
        if num_r <= 1:
            return 0.0
        memo_key = ("dp", tuple(groups), tuple(partitions), self._link_key(groups, speeds))
        if (hit := self._memo.get(memo_key)) is not None:
            return hit  # type: ignore[no-any-return]
        self._memo[memo_key] = out = self._dp_sync(groups, partitions, speeds)
        return out

    def _dp_sync(
        self, groups: Sequence[Sequence[int]], partitions: Sequence[Sequence[int]], speeds: Sequence[float]
    ) -> float:
        num_r = len(partitions)
        num_s = len(partitions[0])
        worst = 0.0
        for s in range(num_s):
            ring = [groups[r * num_s + s] for r in range(num_r)]
            net, factor = self._net(ring, speeds)
            if factor <= 0:
                return float("inf")
            share = 0.0
            for r, part in enumerate(partitions):
                start = sum(part[:s])
                share = max(share, (self._grad[start + part[s]] - self._grad[start]) / len(ring[r]))
            worst = max(worst, 2 * (num_r - 1) / num_r * share / (net.bandwidth * factor))
        return worst + 2 * (num_r - 1) * self.inter.latency


def comm_model(model: str, cluster: str, tokens_per_microbatch: int, num_devices: int) -> CommModel:
    spec, cl = model_preset(model), cluster_preset(cluster)
    return CommModel(
        num_devices=num_devices,
        gpus_per_node=cl.gpus_per_node,
        intra=cl.intra,
        inter=cl.inter,
        act_bytes=tuple(x.output_bytes_per_token * tokens_per_microbatch for x in spec.layers),
        tp_calls=tuple(_TP_COLLECTIVES.get(x.kind, 0) for x in spec.layers),
        grad_bytes=tuple(x.params * _GRAD_BYTES_PER_PARAM for x in spec.layers),
    )


def effective_speeds(speeds: Sequence[float], num_devices: int, comm_share: float) -> tuple[float, ...]:
    """Per device, the speed a policy's per-device timer sees (``n`` entries).

    A slow link shows as a slower device: with compute factor p and link factor l < 1, over a healthy
    stage that spends ``comm_share`` of its time communicating, ``1 / ((1 - share) / p + share / l)``;
    with a healthy link, p itself (0 if either factor is 0)."""
    if len(speeds) <= num_devices:
        return tuple(speeds)
    out = []
    for p, ln in zip(speeds[:num_devices], speeds[num_devices:], strict=True):
        if p <= 0 or ln <= 0:
            out.append(0.0)
        elif ln >= 1.0:
            out.append(p)  # healthy link: the compute factor itself, as without a comm model
        else:
            out.append(1.0 / ((1 - comm_share) / p + comm_share / ln))
    return tuple(out)
