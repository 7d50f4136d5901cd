"""The vocabulary-sharded head: its chained online softmax gives the unsplit head's loss and gradients."""

import copy

import pytest
import torch

from steptune.pipeline.stages import lm_loss, tiny_decoder_layers
from steptune.pipeline.vocab_head import carry_layers, pack_targets, shard_head, sharded_lm_loss


def _run(layers, x, loss_fn, y):
    for layer in layers:
        x = layer(x)
    loss = loss_fn(x, y)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_sharded_head_matches_the_whole_head(shards):
    layers = tiny_decoder_layers(vocab=64, hidden=16, num_layers=2, num_heads=2, seq_len=8, seed=0)
    ref = copy.deepcopy(layers)
    head = layers[-1]
    split = [*carry_layers(layers[0], layers[1:-1]), *shard_head(head.norm, head.out.weight, shards)]
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    tgt[0, :3] = -100  # padding, ignored as cross_entropy ignores it
    want = _run(ref, ids, lm_loss, tgt)
    got = _run(split, pack_targets(ids, tgt), sharded_lm_loss, tgt)
    assert abs(got - want) <= 1e-6 * abs(want)
    grad_w = torch.cat([s.weight.grad for s in split[-shards:]])
    torch.testing.assert_close(grad_w, ref[-1].out.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(head.norm.weight.grad, ref[-1].norm.weight.grad, rtol=1e-5, atol=1e-7)
    for p, q in zip(layers[0].parameters(), ref[0].parameters(), strict=True):  # through every block
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_a_shard_count_beyond_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"num_shards must be in 1\.\.4"):
        shard_head(torch.nn.Identity(), torch.zeros(4, 3), 5)


def test_a_bf16_model_keeps_exact_targets_and_fp32_statistics():
    # bf16 boundaries would round target ids above 256 (1000 -> 1000 only by luck, 1001 -> 1000).
    torch.manual_seed(0)
    vocab, hidden = 2048, 8
    norm = torch.nn.LayerNorm(hidden).to(torch.bfloat16)
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    shards = shard_head(norm, weight, 4)
    h = torch.randn(1, 3, hidden, dtype=torch.bfloat16)
    tgt = torch.tensor([[1001, 1537, 2047]])
    x = torch.cat([h.float(), tgt[..., None].float()], dim=-1)
    for s in shards:
        x = s(x)
    assert x.dtype == torch.float32 and x[..., -1].long().tolist() == [[1001, 1537, 2047]]
    logits = (norm(h) @ weight.t()).float()
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    assert abs(sharded_lm_loss(x).item() - want.item()) <= 1e-5 * abs(want.item())
