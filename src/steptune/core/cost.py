"""Analytic costs: compute time from FLOPs, and alpha-beta times of P2P and collectives.

Contract: every function returns seconds and is pure. ``nbytes`` of a collective is the size of
the *full* (unsharded) buffer ``S``: the all-gather output, the reduce-scatter input, the
all-reduce buffer. Each rank holds ``S / W``. Links are per GPU per direction (``LinkSpec``).

Formulas (Thakur, Rabenseifner & Gropp 2005; NCCL's ring and double-binary-tree):
- ring all-gather / reduce-scatter:   ``(W-1) a + (W-1)/W * S / b``
- recursive doubling AG / halving RS: ``log2(W) a + (W-1)/W * S / b``   (W a power of two)
- ring all-reduce:                    ``2 (W-1) a + 2 (W-1)/W * S / b``
- recursive-doubling all-reduce:      ``log2(W) a + log2(W) * S / b``  (full vector every step)
- Rabenseifner all-reduce (RS + AG):  ``2 log2(W) a + 2 (W-1)/W * S / b``
- pipelined double-binary tree AR:    ``2 log2(W) a + 2 S / b``         (NCCL "tree")
The reduction arithmetic itself is not charged (it overlaps the transfer on GPUs).

Hierarchical collectives over ``W = N x G`` ranks (G per fast domain) run the intra-domain step
on ``S``, the inter-domain step on ``S / G`` across N ranks (one per domain, all G rails in
parallel), then the intra-domain step again where the collective needs it.
"""

from __future__ import annotations

import math
import numbers
from enum import StrEnum

from steptune.core.specs import ClusterSpec, DeviceSpec, LinkSpec

__all__ = [
    "Algorithm",
    "Collective",
    "all_gather_time",
    "all_reduce_time",
    "collective_time",
    "compute_time",
    "group_collective_time",
    "memory_time",
    "p2p_time",
    "reduce_scatter_time",
]


class Collective(StrEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


class Algorithm(StrEnum):
    RING = "ring"
    RECURSIVE = "recursive"  # doubling for AG and AR, halving for RS
    RABENSEIFNER = "rabenseifner"  # all-reduce only
    TREE = "tree"  # all-reduce only


def compute_time(flops: float, device: DeviceSpec, *, efficiency: float = 0.5) -> float:
    """Seconds to run ``flops`` on ``device`` at ``efficiency`` of its dense bf16 peak."""
    if not 0.0 < efficiency <= 1.0:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    _amount("flops", flops)
    return flops / (device.peak_flops * efficiency)


def memory_time(nbytes: float, device: DeviceSpec, *, efficiency: float = 0.8) -> float:
    """Seconds to stream ``nbytes`` through HBM (a copy reads and writes: pass 2x its size)."""
    if not 0.0 < efficiency <= 1.0:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    _amount("nbytes", nbytes)
    return nbytes / (device.memory_bandwidth * efficiency)


def p2p_time(nbytes: float, link: LinkSpec) -> float:
    _amount("nbytes", nbytes)
    return link.latency + nbytes / link.bandwidth


def _check(world: int, nbytes: float) -> None:
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    _amount("nbytes", nbytes)


def _amount(name: str, v: float) -> None:
    """A size or a FLOP count: finite and >= 0 (NaN would pass through every formula); arrays pass
    unchecked."""
    if isinstance(v, numbers.Real) and not 0 <= v < math.inf:
        raise ValueError(f"{name} must be finite and >= 0, got {v}")


def _log2_exact(world: int, algo: Algorithm) -> int:
    log = int(math.log2(world))
    if 1 << log != world:
        raise ValueError(f"{algo.value} needs a power-of-two world size, got {world}; use ring")
    return log


def all_gather_time(
    nbytes: float, world: int, link: LinkSpec, algo: Algorithm | str = Algorithm.RING
) -> float:
    _check(world, nbytes)
    if world == 1:
        return 0.0
    algo = Algorithm(algo)
    frac = (world - 1) / world
    if algo is Algorithm.RING:
        return (world - 1) * link.latency + frac * nbytes / link.bandwidth
    if algo is Algorithm.RECURSIVE:
        return _log2_exact(world, algo) * link.latency + frac * nbytes / link.bandwidth
    raise ValueError(f"all-gather supports ring or recursive, not {algo.value}")


def reduce_scatter_time(
    nbytes: float, world: int, link: LinkSpec, algo: Algorithm | str = Algorithm.RING
) -> float:
    # Same bytes on the wire as all-gather, in the other direction.
    return all_gather_time(nbytes, world, link, algo)


def all_reduce_time(
    nbytes: float, world: int, link: LinkSpec, algo: Algorithm | str = Algorithm.RING
) -> float:
    _check(world, nbytes)
    if world == 1:
        return 0.0
    algo = Algorithm(algo)
    frac = (world - 1) / world
    if algo is Algorithm.RING:
        return 2 * (world - 1) * link.latency + 2 * frac * nbytes / link.bandwidth
    if algo is Algorithm.RECURSIVE:
        log = _log2_exact(world, algo)
        return log * link.latency + log * nbytes / link.bandwidth
    if algo is Algorithm.RABENSEIFNER:
        log = _log2_exact(world, algo)
        return 2 * log * link.latency + 2 * frac * nbytes / link.bandwidth
    # Pipelined double-binary tree: depth ~log2(W) each way, ~full bandwidth once the pipe fills.
    return 2 * math.ceil(math.log2(world)) * link.latency + 2 * nbytes / link.bandwidth


def collective_time(
    kind: Collective | str, nbytes: float, world: int, link: LinkSpec, algo: Algorithm | str = Algorithm.RING
) -> float:
    kind = Collective(kind)
    if kind is Collective.ALL_GATHER:
        return all_gather_time(nbytes, world, link, algo)
    if kind is Collective.REDUCE_SCATTER:
        return reduce_scatter_time(nbytes, world, link, algo)
    return all_reduce_time(nbytes, world, link, algo)


def group_collective_time(
    kind: Collective | str,
    nbytes: float,
    world: int,
    cluster: ClusterSpec,
    algo: Algorithm | str = Algorithm.RING,
) -> float:
    """A collective over ``world`` consecutive ranks of ``cluster``, hierarchical across domains.

    Ranks fill a fast domain (node) first. Within one domain the intra link carries the whole
    collective; across domains the inter-domain step moves ``S / G`` per rail.
    """
    kind = Collective(kind)
    _check(world, nbytes)
    if world > cluster.num_gpus:
        raise ValueError(f"group of {world} ranks does not fit {cluster.name} ({cluster.num_gpus} GPUs)")
    g = cluster.gpus_per_node
    if world <= g:
        return collective_time(kind, nbytes, world, cluster.intra, algo)
    if world % g:
        raise ValueError(f"a group spanning nodes must be a multiple of gpus_per_node={g}, got {world}")
    n = world // g
    algo = Algorithm(algo)
    if algo in (Algorithm.RECURSIVE, Algorithm.RABENSEIFNER) and n & (n - 1):
        lo, hi = g * (1 << (n.bit_length() - 1)), g * (1 << n.bit_length())
        raise ValueError(
            f"{algo.value} across nodes needs a power-of-two node count; {world} ranks span {n} nodes of "
            f"{g} on {cluster.name}: use ring, or {lo} or {hi} ranks"
        )
    intra = collective_time(kind, nbytes, g, cluster.intra, Algorithm.RING)
    if kind is Collective.ALL_REDUCE:
        # RS inside the node, AR of S/G across nodes on each rail, AG inside the node.
        rs = reduce_scatter_time(nbytes, g, cluster.intra, Algorithm.RING)
        return 2 * rs + all_reduce_time(nbytes / g, n, cluster.inter, algo)
    return intra + collective_time(kind, nbytes / g, n, cluster.inter, algo)
