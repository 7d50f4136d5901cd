"""TIDE's configuration and its fallback warning (shared by the FSDP2 integration modules)."""

from __future__ import annotations

from dataclasses import dataclass

from steptune.comm.ag import AG_ALGORITHMS

__all__ = ["TideConfig", "TideFallbackWarning"]


class TideFallbackWarning(UserWarning):
    """A parameter group stays on stock FSDP2; the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TideConfig:
    ag_algorithm: str = "rd"
    """All-gather algorithm: ``rd`` (recursive doubling; Bruck form for non-power-of-two W) or ``direct``."""
    max_inflight_bytes: int | None = None
    """Pacing: cap on all-gather bytes posted at once per round (None: a whole round at once)."""
    rs_chunk_numel: int = 1 << 20
    """Reduce-scatter chunk size in elements (one staging slot)."""
    rs_num_slots: int = 2
    """Staging slots per direction (K): staging is K chunks whatever the world size."""
    rs_two_phase: bool = False
    """Gather outgoing rows into send slots before sending (GPU: separates HBM reads from the wire)."""
    slot_reuse: bool = True
    """Stage the reduce-scatter in the group's just-vacated all-gather slot instead of new memory."""
    persistent_slots: bool = False
    """Never free slots (needed when they are registered NCCL windows)."""
    align_bytes: int = 16
    """Alignment of each parameter's storage inside its slot."""
    self_test: bool = True
    """Run a small all-gather / reduce-scatter on each process group at enable time (and on a separate
    reduce-scatter group set after it, at its first use); fall back if it fails."""

    def __post_init__(self) -> None:
        # exact types: a YAML 1e3 (a float) passed the self-test and failed as a slice in the first backward,
        # and True counted as one slot (a sweep)
        for name in ("rs_chunk_numel", "rs_num_slots", "align_bytes"):
            _check_int(name, getattr(self, name))
        if self.max_inflight_bytes is not None:
            _check_int("max_inflight_bytes", self.max_inflight_bytes)
        for name in ("rs_two_phase", "slot_reuse", "persistent_slots", "self_test"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TideConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.ag_algorithm not in AG_ALGORITHMS:
            raise ValueError(f"ag_algorithm must be one of {AG_ALGORITHMS}, got {self.ag_algorithm!r}")
        if self.rs_chunk_numel < 1 or self.rs_num_slots < 1:
            raise ValueError("rs_chunk_numel and rs_num_slots must be >= 1")
        if self.align_bytes < 4 or self.align_bytes & (self.align_bytes - 1):
            # a slot offset must be a whole number of elements, and TIDE gathers fp32 (4 bytes) and bf16
            raise ValueError(
                f"align_bytes must be a power of two >= 4, a multiple of fp32's 4 bytes (16: 16-byte "
                f"aligned), got {self.align_bytes}"
            )
        if self.max_inflight_bytes is not None and self.max_inflight_bytes < 1:
            raise ValueError(
                f"max_inflight_bytes must be >= 1 byte (None: no limit), got {self.max_inflight_bytes}"
            )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        hint = f" (write {int(value)})" if isinstance(value, float) and value.is_integer() else ""
        raise TypeError(f"TideConfig.{name} must be a whole number (int), got {value!r}{hint}")
