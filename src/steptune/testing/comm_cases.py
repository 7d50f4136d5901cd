"""FSDP2 set-ups that TIDE must leave on stock FSDP2: each must warn and train exactly like stock.

``fallback_rank(rank, group, case)`` runs in a spawned world with a default process group (``SpawnPool(...,
default_group=True)``): it builds the same model twice with the case's FSDP2 options, enables TIDE on one,
trains both for two steps on the same batches and returns the TIDE handle's verdicts, the warnings and
whether the parameters are bitwise equal.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["CASES", "LATE_CASES", "fallback_rank", "late_rank"]

CASES = {
    2: (
        "reduce_bf16",
        "divide_factor",
        "custom_comm",
        "all_reduce_hook",
        "shard_dim1",
        "cpu_offload",
        "world1",
        "compiled_autograd",
        "extension",
        "unsupported_internals",
        "self_test_fails",
        "mixed_dtypes",
        "disable_unsharded",
        "padding_mismatch",
        "mid_accumulation",
        "per_param_mesh",
        "per_param_mesh_experts_first",
        "separate_rs_group",
        "separate_rs_group_fails",
        "separate_rs_group_late",
        "separate_rs_group_late_fails",
    ),
    4: ("hsdp", "reshard_int", "tensor_parallel"),
}


LATE_CASES = ("custom_rs_late", "custom_ag_late", "inference_only", "frozen_layer")
"""Changes after ``enable_tide`` and uses TIDE must follow (``late_rank``; a session-47 sweep)."""


def _custom_rs() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class CustomReduceScatter(DefaultReduceScatter):
        """A user's own reduce-scatter (here: stock's, so results must match)."""

    return CustomReduceScatter()


def _model(case: str = "") -> nn.Sequential:
    torch.manual_seed(0)
    if case.startswith("per_param_mesh"):
        return nn.Sequential(_Experts(experts_first=case.endswith("experts_first")), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 4))


class _Experts(nn.Module):
    """A dense layer beside expert weights that FSDP2 shards on a mesh of their own (two groups on one
    module)."""

    def __init__(self, experts_first: bool) -> None:
        super().__init__()
        if experts_first:  # the parameter order decides which group FSDP2 lists first
            self.experts = nn.Parameter(torch.randn(3, 16, 16) * 0.1)
            self.dense = nn.Linear(16, 16)
        else:
            self.dense = nn.Linear(16, 16)
            self.experts = nn.Parameter(torch.randn(3, 16, 16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x) + torch.einsum("bi,eij->bj", x, self.experts.to(x.dtype))


def _shard(model: nn.Sequential, case: str, mesh: Any, group: Any) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
    if case == "reduce_bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    elif case == "shard_dim1":
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None
    elif case == "cpu_offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif case == "reshard_int":
        kwargs["reshard_after_forward"] = 2
    elif case == "mixed_dtypes":  # no param_dtype: each parameter is gathered in its own dtype
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    elif case == "disable_unsharded":
        kwargs["reshard_after_forward"] = False
    elif case == "mid_accumulation":  # fp32: the no-sync gradient stays on the unsharded parameter
        kwargs["mp_policy"] = MixedPrecisionPolicy()
    elif case.startswith("per_param_mesh"):  # torch 2.13: expert weights on a 1-rank mesh of their own
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

        sub, _ = dist.new_subgroups(group_size=1)
        info = FSDPMeshInfo(mesh=DeviceMesh.from_group(sub, "cpu"), shard_mesh_dim=0)
        place = lambda p: ShardPlacementResult(Shard(0), info) if p.ndim == 3 else None  # noqa: E731
        fully_shard(model[0], shard_placement_fn=place, **kwargs)
        fully_shard(model, **kwargs)
        return
    layers = [m for m in model if isinstance(m, nn.Linear)]
    if case == "mixed_dtypes":  # a frozen fp32 scale beside bf16 weights (values bf16 cannot hold)
        for layer in layers:
            layer.to(torch.bfloat16)
        layers[0].register_parameter("scale", nn.Parameter(torch.full((4,), 1 + 2**-12), requires_grad=False))
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if case in (
        "separate_rs_group",
        "separate_rs_group_fails",
    ):  # torch 2.13: reduce-scatter on a group of its own
        model.set_separate_reduce_scatter_group(True)  # type: ignore[operator]
    for layer in layers:
        if case == "divide_factor":
            layer.set_gradient_divide_factor(float(group.size()))  # type: ignore[operator]
        elif case == "custom_comm":
            layer.set_custom_reduce_scatter(_custom_rs())  # type: ignore[operator]
        elif case == "all_reduce_hook":
            layer.set_all_reduce_hook(lambda t: t.mul_(0.5))  # type: ignore[operator]


def _switch_mid_accumulation(
    stock: nn.Module, tide: nn.Module, opts: list[Any], handle: Any, rank: int
) -> list[str]:
    """Two accumulation windows of two microbatches; TIDE is disabled inside the first and enabled inside the
    second, which must be refused (the switch dropped the first microbatch's gradient before). Returns the
    refusals' messages."""
    from steptune.comm.fsdp import enable_tide

    refused = []
    for window in range(2):
        for micro in range(2):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 + 10 * window + micro + rank))
            for m in (stock, tide):
                m.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]
                m(x).float().pow(2).mean().backward()
            if micro == 0:
                try:
                    handle.disable() if window == 0 else enable_tide(tide)
                except ValueError as err:
                    refused.append(str(err))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if window == 0:
            handle.disable()  # between windows: allowed
    return refused


def _mesh(case: str, group: Any) -> tuple[Any, Callable[[nn.Sequential], None]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if case == "hsdp":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), lambda m: None
    if case == "tensor_parallel":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def tp(m: nn.Sequential) -> None:
            parallelize_module(m, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

        return mesh2["dp"], tp
    if case == "world1":
        sub, _ = dist.new_subgroups(group_size=1)
        return DeviceMesh.from_group(sub, "cpu"), lambda m: None
    return DeviceMesh.from_group(group, "cpu"), lambda m: None


def fallback_rank(rank: int, group: Any, case: str) -> dict[str, Any]:
    from steptune.comm.config import TideFallbackWarning
    from steptune.comm.fsdp import enable_tide

    mesh, prepare = _mesh(case, group)
    stock = _model(case)
    tide = copy.deepcopy(stock)
    for m in (stock, tide):
        prepare(m)
        _shard(m, case, mesh, group)
    from torch._dynamo import compiled_autograd

    import steptune.comm.fsdp as tide_fsdp

    saved = dict(tide_fsdp._SIGNATURES)
    local = next(m for m in tide if isinstance(m, nn.Linear)).weight._local_tensor
    if case == "extension":
        # Detection only: FSDP2 treats a local tensor with fsdp_pre_all_gather as an extension. The marker is
        # removed again before training, so both models then train on stock (a real extension is untested).
        local.fsdp_pre_all_gather = None
    if case == "unsupported_internals":  # as a torch whose FSDP2 internals changed would look
        tide_fsdp._SIGNATURES["foreach_reduce"] = "fsdp_params unsharded_grads something_else"
    from steptune.comm.layout import GroupLayout

    real_shard_numel = GroupLayout.shard_numel
    if case == "padding_mismatch":  # as a torch whose FSDP2 pads its shards otherwise would look
        GroupLayout.shard_numel = lambda self, p: real_shard_numel(self, p) + 1  # type: ignore[method-assign]
    import steptune.comm.selftest as selftest

    real_check = selftest._check
    if case == "self_test_fails":  # one rank's collectives come out wrong: every rank must fall back
        selftest._check = lambda g, d, c: (
            real_check(g, d, c) or ("corrupted on rank 1" if rank == 1 else None)
        )

    def fail_rs_groups() -> None:  # only the separate reduce-scatter groups come out wrong, on rank 1
        rs = {id(g.mesh_info.reduce_scatter_process_group) for g in tide_fsdp._param_groups(tide)}
        selftest._check = lambda g, d, c: (
            real_check(g, d, c) or ("corrupted on rank 1" if rank == 1 and id(g) in rs else None)
        )

    if case == "separate_rs_group_fails":
        fail_rs_groups()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            handle = enable_tide(tide)
        finally:
            tide_fsdp._SIGNATURES.update(saved)
            selftest._check = real_check
            GroupLayout.shard_numel = real_shard_numel  # type: ignore[method-assign]
            local.__dict__.pop("fsdp_pre_all_gather", None)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, tide)]
        if case == "compiled_autograd":
            # Stands in for compiled autograd tracing the backward: the flag its region sets is what TIDE
            # checks at every call (real compiled autograd needs torch.compile, too slow for this box).
            compiled_autograd.in_compiled_autograd_region = True  # type: ignore[attr-defined]
        refused: list[str] = []
        if case.startswith("separate_rs_group_late"):  # set after enable_tide: tested at its first use
            for m in (stock, tide):
                m.set_separate_reduce_scatter_group(True)  # type: ignore[operator]
            if case.endswith("fails"):
                fail_rs_groups()
        try:
            if case == "mid_accumulation":
                refused = _switch_mid_accumulation(stock, tide, opts, handle, rank)
                handle = enable_tide(tide)
            for step in range(2):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
                x = x.to(torch.bfloat16) if case == "mixed_dtypes" else x
                for m, opt in zip((stock, tide), opts, strict=True):
                    m(x).float().pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
        finally:
            compiled_autograd.in_compiled_autograd_region = False  # type: ignore[attr-defined]
            selftest._check = real_check
    if case == "disable_unsharded":  # a no-grad forward leaves the groups unsharded (no reshard after it)
        with torch.no_grad():
            tide(torch.randn(4, 16))
            stock(torch.randn(4, 16))
        try:
            handle.disable()  # corrupted later steps before (1e-2 off)
        except ValueError as err:
            refused = "call disable() between steps with parameters sharded" in str(err)
        else:
            refused = False
        from torch.distributed.fsdp import FSDPModule

        for m in (*tide.modules(), *stock.modules()):
            if isinstance(m, FSDPModule):
                m.reshard()
        handle.disable()
        for step in range(2):  # stock FSDP2 from here, on both
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + step + rank))
            for m, opt in zip((stock, tide), opts, strict=True):
                m(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    equal = all(
        torch.equal(
            a.full_tensor() if hasattr(a, "full_tensor") else a,
            b.full_tensor() if hasattr(b, "full_tensor") else b,
        )
        for a, b in zip(stock.parameters(), tide.parameters(), strict=True)
    )
    if case == "disable_unsharded":
        return {"groups": handle.groups, "refused": refused, "bitwise_equal": equal}
    if case == "mid_accumulation" or case.startswith("separate_rs_group"):
        own = [st._rs_transport is not None and st._rs_transport.group is not st.transport.group
               for st in handle._states]  # fmt: skip
        handle.disable()
        warned = [str(w.message) for w in caught if issubclass(w.category, TideFallbackWarning)]
        return {"groups": handle.groups, "refused": refused, "bitwise_equal": equal, "own_rs_group": own,
                "warnings": warned}  # fmt: skip
    handle.disable()
    return {
        "groups": handle.groups,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, TideFallbackWarning)],
        "bitwise_equal": equal,
    }


def late_rank(rank: int, group: Any, case: str) -> dict[str, Any]:
    """TIDE active, then: a custom reduce-scatter set after ``enable_tide`` (stock's reduce must run it), a
    custom all-gather set after it (refused: TIDE's slot holds the parameters), an evaluation-only job
    under ``torch.inference_mode`` (the slot's first allocation there made it an inference tensor), or a
    frozen layer (its vacated slot must be freed, no reduce-scatter reclaims it). Returns what the test
    checks, with ``bitwise_equal`` against stock FSDP2 on the same inputs."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from steptune.comm.fsdp import enable_tide

    mesh, _ = _mesh("", group)
    stock = _model()
    tide = copy.deepcopy(stock)
    calls = {"stock": 0, "tide": 0}
    for m in (stock, tide):
        if case == "frozen_layer":
            m[2].requires_grad_(False)
        _shard(m, "", mesh, group)
    handle = enable_tide(tide)
    out: dict[str, Any] = {"groups": handle.groups}

    def counting(cls: type, name: str) -> Any:
        class Counting(cls):  # type: ignore[misc, valid-type]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return super().__call__(*args, **kwargs)

        return Counting()

    layers = {
        name: [x for x in m if isinstance(x, nn.Linear)] for name, m in (("stock", stock), ("tide", tide))
    }
    for name, ms in layers.items():
        for layer in ms:
            if case == "custom_rs_late":
                layer.set_custom_reduce_scatter(counting(DefaultReduceScatter, name))  # type: ignore[operator]
            elif case == "custom_ag_late":
                layer.set_custom_all_gather(counting(DefaultAllGather, name))  # type: ignore[operator]
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(2)]
    if case == "inference_only":
        with torch.inference_mode():
            outs = [[m(x) for x in xs] for m in (stock, tide)]
        out["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
        handle.disable()
        return out
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, tide)]
    try:
        for x in xs:
            for m, opt in zip((stock, tide), opts, strict=True):
                m(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    except RuntimeError as err:
        out["refused"] = str(err)
    if case == "frozen_layer":
        out["slots"] = {st.fqn: st.slot.state if st.slot is not None else None for st in handle._states}
    out["custom_calls"] = calls
    out["bitwise_equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(stock.parameters(), tide.parameters(), strict=True)
    )
    handle.disable()
    return out
