"""Slots: the memory that holds a parameter group's unsharded storage, owned by TIDE rather than FSDP2.

Contract. One ``Slot`` per parameter group: a flat buffer of ``layout.slot_numel`` elements; every
parameter's ``all_gather_outputs[0]`` (and so its unsharded ``nn.Parameter``) is a view of it at an aligned
offset. All views share one storage, so FSDP2's own ``free_storage`` (``storage.resize_(0)``, which runs
when the group reshards) frees the whole slot at once, and ``acquire`` re-allocates it before the next
all-gather: views keep pointing at the right bytes because the storage object is the same.

``persistent=True`` never frees (the GPU path registers slots as NCCL windows, which a resize would
break); FSDP2's free is then intercepted per parameter (``FSDPParam.free_unsharded_param`` is replaced on
the instance) and becomes ``release``.

Slot-Reuse: when a group reshards right before its reduce-scatter (FSDP2's post-backward order), ``release``
with ``vacate=True`` keeps the bytes and lends them to the reduce-scatter as staging (``lend``); the
reduce-scatter hands them back (``reclaim``) and only then is the slot freed. A vacated slot never
aliases a live parameter: it is lent only while its group is resharded.
"""

from __future__ import annotations

import torch

__all__ = ["Slot"]


class Slot:
    """The unsharded storage of one parameter group."""

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, *, persistent: bool = False
    ) -> None:
        self.numel = numel
        self.dtype = dtype
        self.persistent = persistent
        self.buffer = torch.empty(numel, dtype=dtype, device=device)
        self._state = "live"
        self.num_allocs = 1
        self.high_water_bytes = self.nbytes

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    @property
    def state(self) -> str:
        """``live`` (holds parameters), ``vacated`` (bytes kept for staging), ``lent``, or ``free``."""
        if self._state == "live" and self.buffer.untyped_storage().size() == 0:
            return "free"  # FSDP2's free_storage ran on one of the views
        return self._state

    def acquire(self) -> torch.Tensor:
        """The buffer, allocated, before an all-gather writes into it."""
        storage = self.buffer.untyped_storage()
        if storage.size() != self.nbytes:
            storage.resize_(self.nbytes)
            self.num_allocs += 1
        self._state = "live"
        return self.buffer

    def release(self, *, vacate: bool = False) -> None:
        """The group resharded: free the bytes, or keep them for the reduce-scatter (Slot-Reuse)."""
        if vacate:
            self._state = "vacated"
        elif not self.persistent:
            self._free()

    def lend(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Staging of ``numel`` ``dtype`` elements carved from a vacated slot, or ``None`` if it cannot be."""
        if self.state != "vacated":
            return None
        flat = self.buffer.view(torch.uint8)
        need = numel * torch.empty(0, dtype=dtype).element_size()
        if need > flat.numel():
            return None
        self._state = "lent"
        return flat[:need].view(dtype)

    def reclaim(self) -> None:
        """The reduce-scatter is done with lent (or vacated) bytes: free them now."""
        if self._state in ("lent", "vacated"):
            self._state = "live"
            if not self.persistent:
                self._free()

    def _free(self) -> None:
        storage = self.buffer.untyped_storage()
        if storage.size():
            storage.resize_(0)
