"""Pipeline stages: a model as a list of units, split into consecutive stages.

Contract:

* A *unit list* is a model as a ``Sequence[nn.Module]`` whose units chain (unit ``k``'s output is
  unit ``k + 1``'s only input). Three builders make one: ``sleep_layers`` (timing harness),
  ``tiny_decoder_layers`` (small real decoder) and ``hf_decoder_layers`` (a transformers causal LM).
* ``split_layers`` never copies: a ``Stage`` holds the very module objects it was given, so its
  parameters *are* the unsplit model's and gradients land in one place. Parameters shared between
  units (tied weights) would be shared between stages too; ``hf_decoder_layers`` refuses tied
  embeddings for that reason.
* ``Stage.forward_collect`` returns every unit's output so the executor can split backward into
  I (``torch.autograd.grad`` on the stage input and all unit outputs but the last) and W (per unit,
  ``torch.autograd.backward(out, grad, inputs=params)``). ``SleepLayer`` makes that split visible:
  its input-gradient node sleeps ``i`` and its parameter-only node sleeps ``w``.
* Sleep times are wall-clock ``time.sleep``, which releases the GIL: thread ranks overlap them
  exactly, whatever the core count. A unit's input path runs only if its input requires grad.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from steptune.pipeline.costs import LayerCosts

__all__ = [
    "SleepLayer",
    "Stage",
    "boundary_shape",
    "hf_decoder_layers",
    "lm_loss",
    "sleep_layers",
    "split_layers",
    "tiny_decoder_layers",
]


class Stage(nn.Module):
    """Consecutive layers of a model: one pipeline stage. Holds only its own parameters."""

    def __init__(self, layers: Sequence[nn.Module], *, index: int, num_stages: int) -> None:
        super().__init__()
        self.index = index
        self.num_stages = num_stages
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward_collect(self, x: Any) -> tuple[Tensor, list[Tensor]]:
        """The stage output and the output of every layer (``outs[-1] is output``)."""
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return x, outs

    def layer_params(self) -> list[list[nn.Parameter]]:
        """Per layer, its trainable parameters (what W runs ``autograd.backward`` on). A parameter several
        layers share goes to the last of them only: that layer's W walks back through the earlier layers'
        graph, so it collects every use in the stage once (listed under each, a tied weight's earlier uses
        were counted twice: a sweep found a shared weight's gradient 0.095 off where it is 0.148)."""
        seen: set[int] = set()
        out: list[list[nn.Parameter]] = []
        for layer in reversed(self.layers):
            mine = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in mine)
            out.append(mine)
        return out[::-1]

    def extra_repr(self) -> str:
        return f"index={self.index}, num_stages={self.num_stages}"


def split_layers(layers: Sequence[nn.Module], partition: Sequence[int]) -> list[Stage]:
    """Split ``layers`` into stages of ``partition[s]`` consecutive layers each (no copies)."""
    if not partition or any(n < 1 for n in partition):
        raise ValueError(f"partition {tuple(partition)} must list at least one layer for every stage")
    if sum(partition) != len(layers):
        raise ValueError(
            f"partition {tuple(partition)} covers {sum(partition)} layers but the model has "
            f"{len(layers)}; make the counts sum to {len(layers)}"
        )
    stages, lo = [], 0
    for s, n in enumerate(partition):
        stages.append(Stage(layers[lo : lo + n], index=s, num_stages=len(partition)))
        lo += n
    return stages


@torch.no_grad()
def boundary_shape(layers: Sequence[nn.Module], example_input: Any) -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each unit's output for one microbatch ``example_input`` (for receive buffers)."""
    out, x = [], example_input
    for k, layer in enumerate(layers):
        x = layer(x)
        if not isinstance(x, torch.Tensor):
            raise TypeError(_NOT_A_TENSOR.format(what=f"unit {k} ({type(layer).__name__}) returns", got=x))
        out.append((x.shape, x.dtype))
    return out


_NOT_A_TENSOR = (
    "{what} a {got.__class__.__name__}: the executor passes one tensor between units and stages, so every "
    "unit's output and every microbatch must be a single tensor; pack extras into it, or wrap the unit so it "
    "returns its main tensor (HF decoder layers: steptune.pipeline.stages.hf_decoder_layers does)"
)


# --- Sleep harness -------------------------------------------------------------------------------


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class _InputPath(torch.autograd.Function):
    """``x * a`` with ``a`` constant: backward gives only the input gradient, after sleeping ``i``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, layer: SleepLayer) -> Tensor:
        ctx.save_for_backward(a)
        ctx.layer = layer
        return x * a

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (a,) = ctx.saved_tensors
        ctx.layer.num_input_backward += 1
        _sleep(ctx.layer.i)
        return grad * a, None, None


class _ParamPath(torch.autograd.Function):
    """The parameter part of ``y = x * a + b`` with ``x`` constant.

    Its value is ``b`` (``x * (a - a_const)`` vanishes at ``a = a_const``) and its backward gives the
    exact ``dy/da`` and ``dy/db``, so ``_InputPath + _ParamPath`` has the true gradients of
    ``x * a + b`` while each gradient comes from its own node.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, b: Tensor, layer: SleepLayer) -> Tensor:
        ctx.save_for_backward(x)
        ctx.layer = layer
        return b.expand_as(x).clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, Tensor, None]:
        (x,) = ctx.saved_tensors
        ctx.layer.num_weight_backward += 1
        _sleep(ctx.layer.w)
        hidden = grad.shape[-1]
        return None, (grad * x).reshape(-1, hidden).sum(0), grad.reshape(-1, hidden).sum(0), None


class SleepLayer(nn.Module):
    """``y = x * a + b`` on ``(..., hidden)`` that sleeps ``f`` in forward, ``i`` in the input-gradient
    node and ``w`` in the parameter-gradient node.

    ``autograd.grad(y, inputs=[x])`` runs only the input node; ``autograd.backward(y, g,
    inputs=[a, b])`` runs only the parameter node. The ``num_*`` counters count calls.
    """

    def __init__(self, f: float, i: float, w: float, *, hidden: int = 16, name: str = "") -> None:
        super().__init__()
        if min(f, i, w) < 0:
            raise ValueError(f"sleep times must be >= 0 seconds, got f={f}, i={i}, w={w}")
        self.f, self.i, self.w, self.name = f, i, w, name
        # Deterministic, close to identity: long chains neither blow up nor vanish.
        self.a = nn.Parameter(1.0 + 0.05 * torch.linspace(-1.0, 1.0, hidden))
        self.b = nn.Parameter(0.01 * torch.linspace(-1.0, 1.0, hidden))
        self.num_forward = self.num_input_backward = self.num_weight_backward = 0

    def forward(self, x: Tensor) -> Tensor:
        self.num_forward += 1
        _sleep(self.f)
        y_input: Tensor = _InputPath.apply(x, self.a.detach(), self)  # type: ignore[no-untyped-call]
        y_param: Tensor = _ParamPath.apply(x.detach(), self.a, self.b, self)  # type: ignore[no-untyped-call]
        return y_input + y_param

    def extra_repr(self) -> str:
        name = f"{self.name!r}, " if self.name else ""
        return f"{name}f={self.f:g}, i={self.i:g}, w={self.w:g}, hidden={self.a.numel()}"


def sleep_layers(costs: LayerCosts, *, scale: float = 1.0, hidden: int = 16) -> list[SleepLayer]:
    """One ``SleepLayer`` per layer of ``costs``, every time multiplied by ``scale``."""
    if scale < 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    names = costs.names or tuple(f"layer{k}" for k in range(costs.num_layers))
    return [
        SleepLayer(f * scale, i * scale, w * scale, hidden=hidden, name=name)
        for f, i, w, name in zip(costs.f, costs.i, costs.w, names, strict=True)
    ]


# --- Tiny real decoder ---------------------------------------------------------------------------


class _Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)

    def forward(self, ids_BS: Tensor) -> Tensor:
        seq_len = ids_BS.shape[1]
        if seq_len > self.pos.num_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds seq_len={self.pos.num_embeddings}")
        x_BSH: Tensor = self.tok(ids_BS) + self.pos(torch.arange(seq_len, device=ids_BS.device))
        return x_BSH


class _Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x_BSH: Tensor) -> Tensor:
        B, S, H = x_BSH.shape
        q, k, v = self.qkv(self.norm1(x_BSH)).view(B, S, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn_BNSD = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BSH = x_BSH + self.proj(attn_BNSD.transpose(1, 2).reshape(B, S, H))
        mlp_BSH: Tensor = self.mlp(self.norm2(x_BSH))
        return x_BSH + mlp_BSH


class _Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x_BSH: Tensor) -> Tensor:
        logits_BSV: Tensor = self.out(self.norm(x_BSH))
        return logits_BSV


def tiny_decoder_layers(
    *,
    vocab: int = 128,
    hidden: int = 32,
    num_layers: int = 4,
    num_heads: int = 4,
    seq_len: int = 16,
    seed: int = 0,
) -> list[nn.Module]:
    """``[embedding, num_layers pre-norm causal blocks, norm + LM head]``.

    Maps token ids ``(B, S)`` int64 to logits ``(B, S, V)``; every block maps ``(B, S, H)`` to itself.

    Weights depend only on ``seed``; the global RNG is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [
            _Embed(vocab, hidden, seq_len),
            *(_Block(hidden, num_heads) for _ in range(num_layers)),
            _Head(hidden, vocab),
        ]


def lm_loss(logits_BSV: Tensor, targets_BS: Tensor) -> Tensor:
    """Mean next-token cross entropy over every position."""
    return F.cross_entropy(logits_BSV.flatten(0, -2).float(), targets_BS.flatten())


# --- transformers causal LMs ---------------------------------------------------------------------


class _HFEmbed(nn.Module):
    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids_BS: Tensor) -> Tensor:
        x_BSH: Tensor = self.embed_tokens(ids_BS)
        return x_BSH


class _HFDecoderLayer(nn.Module):
    """One HF decoder layer; recomputes rotary embeddings for positions ``0..S-1`` (no padding, no cache)."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb

    def forward(self, x_BSH: Tensor) -> Tensor:
        position_ids = torch.arange(x_BSH.shape[1], device=x_BSH.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(x_BSH, position_ids=position_ids)
        # No mask: sdpa then runs with is_causal=True, which is what the model's own causal mask means.
        out = self.layer(
            x_BSH, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings
        )
        y_BSH: Tensor = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
        return y_BSH


class _HFHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, x_BSH: Tensor) -> Tensor:
        logits_BSV: Tensor = self.lm_head(self.norm(x_BSH))
        return logits_BSV


def hf_decoder_layers(model: nn.Module, *, head_shards: int = 1) -> list[nn.Module]:
    """Units ``[embed, decoder layer x N, norm + lm_head]`` around a Llama-style transformers causal LM.

    With ``head_shards`` k > 1 the head is k vocabulary shards (``vocab_head``; the tuner's head split):
    the units then take ``vocab_head.pack_targets(ids, targets)`` and end in ``sharded_lm_loss``. The
    shards hold *copies* of the head's rows: ``model.lm_head`` gets no gradient and is not trained; the
    trained head is ``torch.cat([u.weight for u in shards])``.

    Otherwise the units reuse the model's modules, so gradients land in the model's own parameters (with
    shards: every parameter but ``lm_head``'s). Supported:
    models whose base forward is ``embed_tokens -> layers (with rotary_emb) -> norm`` (checked: Llama and
    Qwen3), built with ``attn_implementation="sdpa"``, full causal attention and untied embeddings.
    Duck-typed: nothing is imported from transformers.
    """
    base, config, lm_head = (getattr(model, n, None) for n in ("model", "config", "lm_head"))
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or config is None or lm_head is None or not all(hasattr(base, n) for n in needed):
        raise ValueError(
            f"{type(model).__name__} is not a Llama-style causal LM: need model.lm_head and "
            f"model.model.{{{', '.join(needed)}}}"
        )
    if getattr(config, "_attn_implementation", None) != "sdpa":
        raise ValueError(
            f"the units call decoder layers without a mask and rely on sdpa's is_causal; build the model "
            f'with attn_implementation="sdpa" (got {getattr(config, "_attn_implementation", None)!r})'
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(
            f"only full causal attention is supported (layer_types has {sorted(layer_types)}); "
            "disable sliding windows in the config"
        )
    if lm_head.weight is base.embed_tokens.weight:
        raise ValueError(
            "tied embeddings would put one parameter in the first and the last stage; build the model with "
            "tie_word_embeddings=False"
        )
    num_layers = getattr(config, "num_hidden_layers", len(base.layers))
    blocks = [_HFDecoderLayer(layer, base.rotary_emb) for layer in base.layers[:num_layers]]
    if head_shards > 1:
        from steptune.pipeline.vocab_head import carry_layers, shard_head

        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the vocabulary-sharded head supports an lm_head without bias (Llama-style)")
        trunk = carry_layers(_HFEmbed(base.embed_tokens), blocks)
        return [*trunk, *shard_head(base.norm, lm_head.weight, head_shards)]
    return [_HFEmbed(base.embed_tokens), *blocks, _HFHead(base.norm, lm_head)]
