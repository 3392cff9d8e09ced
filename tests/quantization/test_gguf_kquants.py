"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) run as shipped.

Blocks are random bytes with sane fp16 scales, so every 6-bit scale/min code and every quant
value occurs; the oracle is `gguf.quants.dequantize`, the format's own reader:
  - the weights the kernel multiplies equal it bit for bit, for each type;
  - the quantized product equals x @ W^T of those weights to float32 rounding;
  - a tiny llama GGUF whose linears are K-quants (llama.cpp's q/k row permutation included)
    loads them as shipped, and its greedy output equals the same file dequantized to float32
    (the same weights; only the kernel's summation order differs, so the tie rule applies).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.quantization.gguf import SHIPPED_TYPES, from_gguf_blocks
from kvflow.quantization.kernels import quant_linear

Q = gguf.GGMLQuantizationType
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each fp16 d / dmin


def random_blocks(rng: np.random.Generator, qtype: Q, n: int, k: int) -> np.ndarray:
    """[n, k / 256 * block bytes] of random quants and scale codes, with d (and dmin) drawn
    from [1e-4, 2e-3] so that the weights have a usual magnitude."""
    kind = SHIPPED_TYPES[int(qtype)]
    blocks = rng.integers(0, 256, size=(n, k // 256, kind.block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype]:
        scale = rng.uniform(1e-4, 2e-3, size=(n, k // 256)).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_weights_are_gguf_dequantization_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(rng, qtype, 24, 768)
    weight = from_gguf_blocks(raw, int(qtype), (24, 768))
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    assert weight.source == f"gguf:{qtype.name}" and weight.shape == (24, 768)
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert weight.nbytes < 24 * 768 * 2  # less than bf16


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_product_matches_the_dequantized_matmul(qtype, rows):
    rng = np.random.default_rng(100 + rows)
    weight = from_gguf_blocks(random_blocks(rng, qtype, 40, 512), int(qtype), (40, 512))
    x = torch.randn(rows, 512)
    torch.testing.assert_close(quant_linear(x, weight, None), x @ weight.dequantize().T, atol=1e-4, rtol=1e-4)


# A tiny llama whose every in_features is a multiple of 256, the K-quants' super-block.
H, HEADS, KV, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 320, 2
LINEAR_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
                "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}


def _write_kquant_llama(path, embedding_type: Q = Q.F32) -> None:
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, H), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_bos_token_id, 1),
                       (writer.add_eos_token_id, 2), (writer.add_vocab_size, VOCAB)):
        add(value)
    # A minimal llama (SentencePiece-style) vocabulary, so that the file has a tokenizer.
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, VOCAB))])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([2, 3, 3, *([1] * (VOCAB - 3))])
    d = H // HEADS
    if embedding_type == Q.F32:
        writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, H)).astype(np.float32))
    else:  # the model dequantizes the table from its blocks (no float32 copy from the loader)
        writer.add_tensor("token_embd.weight", random_blocks(rng, embedding_type, VOCAB, H), raw_dtype=embedding_type)
    writer.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    writer.add_tensor("output.weight", random_blocks(rng, Q.Q6_K, VOCAB, H), raw_dtype=Q.Q6_K)
    shapes = {"attn_q": (HEADS * d, H), "attn_k": (KV * d, H), "attn_v": (KV * d, H), "attn_output": (H, HEADS * d),
              "ffn_gate": (FFN, H), "ffn_up": (FFN, H), "ffn_down": (H, FFN)}
    for i in range(LAYERS):
        for part in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{part}.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        for part, (n, k) in shapes.items():
            qtype = LINEAR_TYPES[part]
            writer.add_tensor(f"blk.{i}.{part}.weight", random_blocks(rng, qtype, n, k), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("embedding_type", [Q.F32, Q.Q6_K], ids=["f32-table", "q6k-table"])
def test_kquant_file_runs_as_shipped_and_matches_its_dequantization(tmp_path, embedding_type):
    path = tmp_path / "tiny-kquants.gguf"
    _write_kquant_llama(path, embedding_type)
    kwargs = dict(dtype="float32", kv_cache_memory=4 << 20, max_model_len=128)
    shipped = LLM(str(path), quantization="gguf", **kwargs)
    model = shipped.engine.runner.model
    sources = {m.quant_weight.source for m in model.modules() if getattr(m, "quant_weight", None) is not None}
    # q/k (Q4_K) and v (Q6_K) share the fused QKV, as do gate (Q5_K) and up (Q4_K): widened to int8.
    assert sources == {"gguf:Q4_K+gguf:Q6_K", "gguf:Q5_K+gguf:Q4_K", "gguf:Q4_K", "gguf:Q6_K"}
    assert shipped.engine.plan.weight_format == "gguf (Q4_K, as shipped)"
    dequantized = LLM(str(path), quantization="none", **kwargs)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, size=int(rng.integers(4, 40))).tolist()} for _ in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=2)
    for ours, ref in zip(shipped.generate(prompts, greedy, use_tqdm=False),
                         dequantized.generate(prompts, greedy, use_tqdm=False)):
        a, b = ours.outputs[0], ref.outputs[0]
        i = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is not None:  # only at a near-tie of the float run
            top2 = sorted((lp.logprob for lp in b.logprobs[i].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < 1e-3, f"diverged at step {i} away from a tie"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_table_is_the_dequantized_table(tmp_path, dtype):
    """A table the loader hands over as blocks (dequantized by the model, 4,096 rows at a time)
    has the bits of the file dequantized at load (here an untied Q6_K table; test_gguf.py checks the
    default model's tied Q8_0 table against gguf's own dequantization)."""
    from kvflow.layers.attention import CPUAttentionBackend
    from kvflow.loader import load_model, load_model_config, resolve_quantization

    path = tmp_path / "tiny-kquants.gguf"
    _write_kquant_llama(path, Q.Q6_K)
    cfg = load_model_config(str(path))
    shipped, plain = (load_model(str(path), cfg, dtype, CPUAttentionBackend(),
                                 quantization=resolve_quantization(str(path), q, dtype="auto"))
                      for q in ("gguf", "none"))
    assert isinstance(shipped.embed_tokens, torch.nn.Embedding)  # untied: the table stays a table
    assert torch.equal(shipped.embed_tokens.weight, plain.embed_tokens.weight)
