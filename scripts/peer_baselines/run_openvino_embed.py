"""OpenVINO on W-embed, back to back with `kvflow bench embed --text`.

The peer is the OpenVINO runtime running optimum-intel's feature-extraction export of the
default model: texts sorted by length, batches of 16 (as sentence-transformers batches),
right-padded with an attention mask and position ids, the last real token's hidden state,
L2-normalised. (OpenVINO GenAI's own TextEmbeddingPipeline, 2026.4.1, is not used: on this
export its vectors disagree with transformers', cosine 0.60 on a 2-token text and NaN on a
14-token one, while the runtime's agree with both transformers and kvflow to 1e-7.)

Both engines get the same text: each W-embed draw (`kvflow/bench/embed.py`: 64 prompts,
`default_rng(seed).integers(16, 257, 64)` lengths, ids in [1000, 40000)) decoded with the
model's tokenizer; tokens are counted after tokenizing it again. The warm-up embeds another
draw (seed + 100). Prints one JSON line per timed draw, then the median; `--save-vectors
PREFIX` writes each draw's vectors (draw order) to PREFIX_<seed>.npy, to compare with kvflow's
(`kvflow bench embed --text --save-vectors`).

Set-up (the venv of scripts/peer_baselines/README.md; the export takes about a minute):
    HF_HUB_OFFLINE=1 /work/peers/ov/bin/optimum-cli export openvino --model /work/peers/hf-smollm2 \\
        --task feature-extraction --weight-format fp32 /work/peers/ov-embed-fp32
    /work/peers/ov/bin/python scripts/peer_baselines/run_openvino_embed.py --seeds 4,5,6
"""
import argparse
import json
import resource
import statistics
import time

import numpy as np


def embed_draw(seed: int, n: int = 64, lo: int = 16, hi: int = 256) -> list[list[int]]:
    """kvflow.bench.embed.embed_prompts, numpy only (this venv has no kvflow)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, n)
    return [rng.integers(1000, 40000, size=int(k)).tolist() for k in lens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/work/peers/ov-embed-fp32")
    ap.add_argument("--tokenizer", default="/work/peers/hf-smollm2")
    ap.add_argument("--seeds", default="4,5,6")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--precision", default="f32", help="INFERENCE_PRECISION_HINT: f32 or bf16")
    ap.add_argument("--save-vectors", metavar="PREFIX")
    args = ap.parse_args()

    import openvino as ov
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model = ov.Core().compile_model(f"{args.model}/openvino_model.xml", "CPU",
                                    {"INFERENCE_PRECISION_HINT": args.precision})

    def embed(texts: list[str]) -> tuple[np.ndarray, float, int]:
        ids = [tok(t).input_ids for t in texts]
        order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
        vectors = [None] * len(texts)
        start = time.perf_counter()
        for lo in range(0, len(order), args.batch_size):
            rows = order[lo:lo + args.batch_size]
            width = max(len(ids[i]) for i in rows)
            batch = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros_like(batch)
            for r, i in enumerate(rows):
                batch[r, :len(ids[i])], mask[r, :len(ids[i])] = ids[i], 1
            positions = np.broadcast_to(np.arange(width), batch.shape).copy()
            hidden = model({"input_ids": batch, "attention_mask": mask, "position_ids": positions})[0]
            for r, i in enumerate(rows):
                v = hidden[r, len(ids[i]) - 1].astype(np.float32)
                vectors[i] = v / np.linalg.norm(v)
        return np.asarray(vectors, dtype=np.float32), time.perf_counter() - start, sum(len(x) for x in ids)

    seeds = [int(s) for s in args.seeds.split(",")]
    embed([tok.decode(p) for p in embed_draw(seeds[0] + 100, args.num_prompts)][:32])  # warm-up, another draw
    figures = []
    for seed in seeds:
        vectors, wall, tokens = embed([tok.decode(p) for p in embed_draw(seed, args.num_prompts)])
        if args.save_vectors:
            np.save(f"{args.save_vectors}_{seed}.npy", vectors)
        figures.append({"engine": f"OpenVINO runtime ({args.precision}), batches of {args.batch_size}", "seed": seed,
                        "prompts": args.num_prompts, "tokens": tokens, "wall_s": round(wall, 3),
                        "tokens_per_s": round(tokens / wall, 1),
                        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})
        print(json.dumps(figures[-1]), flush=True)
    print(json.dumps({"median_tokens_per_s": statistics.median(f["tokens_per_s"] for f in figures)}))


if __name__ == "__main__":
    main()
