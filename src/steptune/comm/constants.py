"""Constants of TIDE's cost model, each with its source; calibration replaces them with measurements.

Rates of the layout kernels come from PyTorch's own measurements on H100 (PR numbers below). On another
device they are scaled by its HBM bandwidth relative to H100's 3.35 TB/s (an assumption, labelled in
docs/comm.md) until ``steptune comm calibrate`` replaces them with figures from ``benchmarks/gpu/comm.py``.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from steptune.core.specs import DeviceSpec

__all__ = ["H100_HBM", "CommConstants", "calibrated"]

H100_HBM = 3.35e12
"""H100 SXM HBM3 bytes/s (datasheet): the device the cited kernel rates were measured on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommConstants:
    copy_out_bytes_per_s: float = 650e9
    """FSDP2 all-gather copy-out (``split_with_sizes_copy`` CUDA fast path): 650-700 GB/s of output
    (pytorch/pytorch PR #115515, merged as PR #117203)."""
    chunk_cat_elems_per_s: float = 278e9
    """Reduce-scatter copy-in ``_chunk_cat``, bf16 in, fp32 out: 278 G elements/s on H100 (PR #120678)."""
    pack_elems_per_s: float = 500e9
    """Same-dtype bf16 ``_chunk_cat``: 500 G elements/s on H100 (PR #120678); used for the copy-in pack."""
    cast_elems_per_s: float = 278e9
    """fp32 -> bf16 cast of the local shard. Assumption: the mixed-dtype rate of PR #120678."""
    accumulate_elems_per_s: float = 278e9
    """TIDE-RS fp32 accumulation of bf16 rows (read bf16, read-modify-write fp32). Assumption: the
    mixed-dtype elementwise rate of PR #120678."""
    nccl_ctas: int = 16
    """SMs a default NCCL ring all-gather / reduce-scatter holds while it runs: ~16 on a DGX with 8 NICs
    (NVIDIA/nccl#689; NCCL CTAs never share an SM with compute)."""
    symm_rs_ctas: int = 16
    """SMs of NCCL's symmetric reduce-scatter kernel. Assumption: the same channel count (tuning is open,
    NVIDIA/nccl#2305)."""
    tide_acc_ctas: int = 16
    """SMs TIDE-RS's short accumulation CTAs hold, only while they accumulate. Assumption: the NCCL budget."""
    gemm_tile: tuple[int, int] = (128, 256)
    """Output tile of a Hopper bf16 GEMM (CUTLASS sm90 warp-specialized default 128x256), for wave counts."""
    hbm_contention: float = 0.0
    """gamma: compute slows by ``1 + gamma * u_hbm`` while communication uses a fraction ``u_hbm`` of HBM
    bandwidth. 0 until fitted from the H200 interference benchmark (research brief: 0.3-1)."""
    matmul_efficiency: float = 0.5
    """Fraction of dense bf16 peak a layer's compute reaches (steptune.core's FSDP step default)."""
    nvls_reduction: bool = True
    """Reduce within an NVSwitch domain in the switch (NVLS, multimem ld_reduce); then TIDE's CTAs only
    accumulate one partial per domain. All three cluster presets have NVSwitch."""
    rs_chunk_bytes: int = 64 << 20
    """TIDE-RS staging chunk (bf16 bytes)."""
    rs_num_slots: int = 2
    """TIDE-RS staging slots per direction (K)."""
    calibrated_from: str = ""
    """Where measured values came from (empty: all constants as cited above)."""
    fitted: tuple[str, ...] = ()
    """The constants measured on hardware (the rest are cited)."""
    calibrated_device: str = ""
    """The device those were measured on, as the GPU names itself ("NVIDIA H200")."""
    unfitted: tuple[tuple[str, str], ...] = ()
    """(constant, why) for each value the file fits that was not applied (``hbm_contention`` inside noise)."""

    def for_device(self, device: DeviceSpec) -> CommConstants:
        """Kernel rates on ``device``: cited (H100) rates scaled by HBM bandwidth; measured ones as they are
        on the device they were measured on, and scaled by HBM bandwidth from it on another (see
        ``device_note``)."""
        scaled = {}
        for k in _RATES:
            if k in self.fitted:
                source = _bandwidth_of(self.calibrated_device)
                if source is None or device_token(device.name) == device_token(self.calibrated_device):
                    continue
                scaled[k] = getattr(self, k) * device.memory_bandwidth / source
            else:
                scaled[k] = getattr(self, k) * device.memory_bandwidth / H100_HBM
        return replace(self, **scaled) if scaled else self

    def device_note(self, device: DeviceSpec) -> str | None:
        """What a table on ``device`` should say about measured rates from another device, else None."""
        if not self.fitted or device_token(device.name) == device_token(self.calibrated_device):
            return None
        if _bandwidth_of(self.calibrated_device) is None:
            return (
                f"rates measured on {self.calibrated_device or 'an unknown device'} are used unscaled on "
                f"{device.name}: calibrate on the device you simulate"
            )
        return (
            f"rates measured on {self.calibrated_device}, scaled to {device.name} by HBM bandwidth "
            "(an assumption): calibrate on the device you simulate"
        )


_RATES = (
    "copy_out_bytes_per_s",
    "chunk_cat_elems_per_s",
    "pack_elems_per_s",
    "cast_elems_per_s",
    "accumulate_elems_per_s",
)


def device_token(name: str) -> str:
    """The GPU model in a device name: "H200" in "NVIDIA H200" and in "H200-SXM-141GB"."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4})", name.upper())
    return m.group(1) if m else name


@functools.cache
def _bandwidth_of(device_name: str) -> float | None:
    """The HBM bandwidth of the cluster preset whose device is ``device_name`` (presets read once)."""
    from steptune.core.specs import cluster_preset, list_cluster_presets

    for preset in list_cluster_presets():
        d = cluster_preset(preset).device
        if device_token(d.name) == device_token(device_name):
            return d.memory_bandwidth
    return None


_CALIBRATABLE = (*_RATES, "hbm_contention")


def calibrated(path: str | Path, base: CommConstants | None = None) -> CommConstants:
    """Constants with the fitted values of a ``benchmarks/gpu/comm.py`` JSON (its ``"fit"`` section)."""
    try:
        data: Any = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from None
    fit = data.get("fit") if isinstance(data, dict) else None
    if not isinstance(fit, dict) or not fit:
        raise ValueError(f"{path}: no 'fit' section; produce it with benchmarks/gpu/comm.py --json")
    unknown = sorted(set(fit) - set(_CALIBRATABLE))
    if unknown:
        raise ValueError(f"{path}: unknown fitted constants {unknown}; known: {list(_CALIBRATABLE)}")
    for k, v in fit.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not number or v < 0 or (k != "hbm_contention" and v == 0):
            raise ValueError(f"{path}: fitted {k}={v!r} is not a positive number")
    names = {f.name for f in fields(CommConstants)}
    assert set(_CALIBRATABLE) <= names
    fit = dict(fit)
    unfitted = []
    if "hbm_contention" in fit and (why := gamma_unresolved(data.get("interference"))) is not None:
        del fit["hbm_contention"]  # inside the method's noise: the cited value stays
        unfitted.append(("hbm_contention", why))
    device = str(data.get("device", "unknown device"))
    return replace(
        base or CommConstants(),
        **fit,
        calibrated_from=f"{path} ({device})",
        fitted=tuple(fit),
        calibrated_device=device,
        unfitted=tuple(unfitted),
    )


def gamma_resolved(interference: Any) -> bool:
    """Whether a comm.py interference section resolves gamma: the GEMM's slowdown beside the copy is over
    twice what the same baseline measured twice differs by. Files from before that baseline existed
    (no ``alone_again_s``) do not resolve it."""
    return gamma_unresolved(interference) is None


def gamma_unresolved(interference: Any) -> str | None:
    """Why an interference section does not resolve gamma (None when it does)."""
    if not isinstance(interference, dict):
        return "the file has no interference section"
    try:
        base = float(interference["gemm"]["alone_s"])
        slow = float(interference["with_ce_copy_s"]) / base - 1
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return "its interference section lacks the GEMM's times"
    try:
        floor = abs(float(interference["alone_again_s"]) / base - 1)
    except (KeyError, TypeError, ValueError):
        return "the file has no repeated baseline (alone_again_s) to tell the slowdown from noise"
    if slow <= 2 * floor:
        return f"the slowdown ({slow:+.1%}) is inside twice the baseline's own spread ({floor:.1%})"
    return None
