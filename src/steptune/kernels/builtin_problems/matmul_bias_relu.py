import torch
from torch import nn

DESCRIPTION = "Linear layer then ReLU: (256, 1024) @ W(1024, 1024)^T + b, fp32"

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
    "aten.relu",
]

BATCH, IN_FEATURES, OUT_FEATURES = 256, 1024, 1024


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs() -> list:
    return [IN_FEATURES, OUT_FEATURES]
