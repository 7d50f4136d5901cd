import torch
from torch import nn

DESCRIPTION = "Batched matmul, (32, 128, 256) @ (32, 256, 128) fp32"

# The reference's ops and every BLAS entry point, since otherwise torch.bmm, addmm or einsum would
# pass for a new kernel while calling the same library GEMM.
FORBIDDEN_OPS = [
    "aten.mm",
    "aten.bmm",
    "aten.addmm",
    "aten.baddbmm",
    "aten.addbmm",
    "aten._addmm_activation",
    "aten.mv",
    "aten.addmv",
    "aten.dot",
    "aten.vdot",
]

BATCH, M, K, N = 32, 128, 256, 128


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, M, K), torch.randn(BATCH, K, N)]


def get_init_inputs() -> list:
    return []
