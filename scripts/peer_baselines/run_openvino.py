"""OpenVINO GenAI (ContinuousBatchingPipeline, paged KV) on kvflow's W-offline and W-latency.

Run with the python of its own venv (see README.md here); never a kvflow dependency. The model
is the optimum-cli int8 export of the default model (README.md says how it is made), the
scheduler and properties exactly as /work/shared/workloads/README.md gives them:
SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32, dynamic_split_fuse=True,
enable_prefix_caching=False) and {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"}.

W-offline: the 32 requests go to one `generate()` call (the pipeline adds them all, then
steps until the last finishes), greedy, `ignore_eos`, `min_new_tokens = max_new_tokens =
output_len`. W-latency: one request through `add_request()` and `step()`, a timestamp per
token as `read()` hands it over; TTFT is submission to the first token, ITL the mean gap
over the other 127.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import openvino as ov  # noqa: E402
import openvino_genai as ov_genai  # noqa: E402

DEFAULT_MODEL = "/work/peers/ov-model-int8"


def scheduler_config(args) -> "ov_genai.SchedulerConfig":
    sc = ov_genai.SchedulerConfig()
    sc.max_num_batched_tokens = args.max_num_batched_tokens
    sc.max_num_seqs = args.max_num_seqs
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = False
    if args.cache_size_gb:
        sc.cache_size = args.cache_size_gb
    return sc


def properties(args) -> dict:
    props = {"INFERENCE_PRECISION_HINT": args.precision, "KV_CACHE_PRECISION": args.kv_precision}
    if args.threads != os.cpu_count():  # OpenVINO uses every core unless told otherwise
        props["INFERENCE_NUM_THREADS"] = args.threads
    return props


def greedy(n_out: int) -> "ov_genai.GenerationConfig":
    cfg = ov_genai.GenerationConfig()
    cfg.do_sample = False
    cfg.ignore_eos = True
    cfg.max_new_tokens = cfg.min_new_tokens = n_out
    return cfg


def ids_tensor(prompt: list[int]) -> "ov.Tensor":
    return ov.Tensor(np.asarray([prompt], dtype=np.int64))


def generate_all(pipe, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
    results = pipe.generate([ids_tensor(p) for p in prompts], [greedy(n) for n in out_lens])
    return [list(r.m_generation_ids[0]) for r in results]


class Streamer:
    """One request at a time through add_request/step, timing each token as it is read."""

    def __init__(self, pipe):
        self.pipe, self.next_id = pipe, 0

    def __call__(self, prompt: list[int], n_out: int) -> tuple[float, list[float], list[int]]:
        request_id, self.next_id = self.next_id, self.next_id + 1
        start = time.perf_counter()
        handle = self.pipe.add_request(request_id, ids_tensor(prompt), greedy(n_out))
        times, tokens = [], []
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            if handle.can_read():
                now = time.perf_counter()
                for out in handle.read().values():
                    tokens += list(out.generated_ids)
                    times += [now] * len(out.generated_ids)
        if handle.get_status() != ov_genai.GenerationStatus.FINISHED:
            raise SystemExit(f"request {request_id} ended as {handle.get_status()}")
        return start, times, tokens


def run_offline(pipe, args, ident: dict) -> list[dict]:
    def kv_cache(fig: dict, generated) -> None:
        metrics = pipe.get_metrics()  # the KV cache grows on demand when cache_size is 0
        fig["kv_cache_mb"] = round(metrics.kv_cache_size_in_bytes / 2**20, 1)
        fig["max_cache_usage_pct"] = round(metrics.max_cache_usage, 1)

    return common.time_offline(lambda prompts, out_lens: generate_all(pipe, prompts, out_lens), args, ident,
                               kv_cache)


def run_latency(pipe, args, ident: dict) -> list[dict]:
    stream = Streamer(pipe)
    return common.time_latency(stream, args, ident)


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="an optimum-cli OpenVINO export directory")
    ap.add_argument("--weights", default="int8", help="a label for the JSON (what the export holds)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--cache-size-gb", type=int, default=0, help="KV cache GB; 0: OpenVINO sizes it itself")
    ap.add_argument("--precision", default="bf16", help="INFERENCE_PRECISION_HINT")
    ap.add_argument("--kv-precision", default="bf16", help="KV_CACHE_PRECISION")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.model, "openvino_model.xml")):
        raise SystemExit(f"--model {args.model}: no openvino_model.xml there (see README.md for the export)")
    sc, props = scheduler_config(args), properties(args)
    t = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(args.model, sc, "CPU", props)
    startup = time.perf_counter() - t
    ident = {"engine": "openvino-genai", "openvino_genai": ov_genai.__version__, "openvino": ov.__version__,
             "weights": args.weights, "properties": props, "scheduler": {
                 "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                 "dynamic_split_fuse": sc.dynamic_split_fuse, "enable_prefix_caching": sc.enable_prefix_caching,
                 "cache_size_gb": sc.cache_size}, "startup_s": round(startup, 1), **common.machine()}
    print(f"openvino-genai {ov_genai.__version__}, openvino {ov.__version__}; pipeline start-up {startup:.1f} s; "
          f"model {args.model}", flush=True)
    if args.workload in ("offline", "both"):
        run_offline(pipe, args, ident)
    if args.workload in ("latency", "both"):
        run_latency(pipe, args, ident)


if __name__ == "__main__":
    main()
