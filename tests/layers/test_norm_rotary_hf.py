"""RMSNorm, SiluAndMul and RotaryEmbedding (kernel path when the kernels build) against Hugging
Face's Llama implementation: LlamaRMSNorm, the MLP's silu(gate) * up, and LlamaRotaryEmbedding +
apply_rotary_pos_emb.

Guards:
  - float32: kvflow matches Hugging Face to 1e-6, for the plain norm and the residual-fused one
    (Hugging Face adds the residual in the decoder layer, `residual + x`, then normalises);
  - rotary tables: default and llama3-scaled frequencies match Hugging Face's, at mixed positions;
  - bfloat16: the same rounding points as Hugging Face, so the results are bitwise the same but for
    at most a tiny fraction of elements one bf16 ulp away.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.layers.activation import SiluAndMul
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from tests.conftest import assert_nearly_bitwise

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
LlamaConfig = pytest.importorskip("transformers").LlamaConfig

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, MAX_POS = 64, 6, 2, 4096


def assert_matches_hf(got: torch.Tensor, expected: torch.Tensor, max_fraction: float = 1e-3) -> None:
    assert_nearly_bitwise(got, expected, max_fraction, label=" from Hugging Face")


def norm_pair(hidden: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(hidden)
    weight = 1 + 0.3 * torch.randn(hidden, generator=g)
    ours, theirs = RMSNorm(hidden, eps=1e-5), llama.LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    return ours.to(dtype).requires_grad_(False), theirs.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (70, 576), (9, 40)])
def test_rms_norm_matches_hf(rows, hidden, dtype):
    ours, theirs = norm_pair(hidden, dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = (4 * torch.randn(rows, hidden, generator=g)).to(dtype)
    with torch.no_grad():
        assert_matches_hf(ours(x), theirs(x))
        hf_residual = residual + x  # LlamaDecoderLayer: hidden_states = residual + hidden_states
        hf_out = theirs(hf_residual)
        out, res = ours(x, residual.clone())
    assert torch.equal(res, hf_residual)
    assert_matches_hf(out, hf_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_hf_mlp_activation(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up = (3 * torch.randn(2, 33, 1536, generator=g)).to(dtype)
    out = SiluAndMul()(torch.cat([gate, up], dim=-1))
    assert_matches_hf(out, F.silu(gate) * up)  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), act_fn = SiLU


ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", list(ROPE))
def test_rotary_matches_hf(rope, dtype):
    params = ROPE[rope]
    config = LlamaConfig(hidden_size=NUM_HEADS * HEAD_DIM, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rope_parameters=dict(params))
    hf_rotary = llama.LlamaRotaryEmbedding(config)
    scaling = None if rope == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    ours = RotaryEmbedding(HEAD_DIM, MAX_POS, params["rope_theta"], scaling).to(dtype)

    g = torch.Generator().manual_seed(1)
    positions = torch.cat([torch.tensor([4000, 517]), torch.arange(0, 9), torch.arange(1000, 1013)])
    q = torch.randn(len(positions), NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(len(positions), NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)

    # Hugging Face's layout: [batch, heads, seq, head_dim], cos/sin [batch, seq, head_dim].
    cos, sin = hf_rotary(q, positions[None])
    hf_q, hf_k = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q.clone(), k.clone())
    assert_matches_hf(q_out, hf_q[0].transpose(0, 1).contiguous())
    assert_matches_hf(k_out, hf_k[0].transpose(0, 1).contiguous())
