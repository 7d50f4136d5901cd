import pytest

from steptune.core._builders import build_model


def _hybrid(pattern):
    return {
        "family": "hybrid",
        "seq_len": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "num_hidden_layers": 3,
        "hybrid_override_pattern": pattern,
        "num_attention_heads": 4,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "ssm_state_size": 8,
    }


def test_hybrid_pattern_length_must_match():
    with pytest.raises(ValueError, match="make them agree"):
        build_model("x", _hybrid("M-"))


def test_hybrid_unknown_code():
    with pytest.raises(ValueError, match="unknown layer code"):
        build_model("x", _hybrid("M-X"))


def test_unknown_family_and_missing_key():
    with pytest.raises(ValueError, match="family must be one of"):
        build_model("x", {"family": "rnn"})
    with pytest.raises(ValueError, match="hidden_size"):
        build_model("x", {"family": "dense", "seq_len": 8})


def test_mamba_scan_is_weight_free():
    m = build_model("x", _hybrid("M*-"))
    mamba = m.layers[1]
    assert (
        mamba.b_flops_per_token
        > mamba.f_flops_per_token
        == mamba.w_flops_per_token + (mamba.b_flops_per_token - mamba.f_flops_per_token)
    )
