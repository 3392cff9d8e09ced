#!/usr/bin/env bash
# The peers' W-offline and W-latency figures, each workload in a process of its own (so each
# peak RSS is that workload's): all output on stderr, the JSON lines also appended to $RESULTS.
#
#   scripts/peer_baselines/run.sh [all|openvino|llamacpp] [--smoke] [--repeat N] [--threads N]
#   scripts/peer_baselines/run.sh all --smoke      # pipeline check: 2 requests, 8 tokens
#
# The options after the first word go to both scripts; OV_ARGS / LLAMA_ARGS add options for one
# only (e.g. LLAMA_ARGS="--kv-split"). OV_VENV / LLAMA_VENV: the venvs of README.md here;
# OV_MODEL: the int8 export; RESULTS: where the JSON lines go.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OV_VENV="${OV_VENV:-/work/peers/ov}"
LLAMA_VENV="${LLAMA_VENV:-/work/peers/llama}"
OV_MODEL="${OV_MODEL:-/work/peers/ov-model-int8}"
RESULTS="${RESULTS:-peer-results-$(date -u +%Y%m%dT%H%M%SZ).jsonl}"
which="${1:-all}"
[ $# -gt 0 ] && shift
case "$which" in all|openvino|llamacpp) ;; *) echo "usage: $0 [all|openvino|llamacpp] [--smoke ...]" >&2; exit 2;; esac

read -ra ov_args <<< "${OV_ARGS:-}"
read -ra llama_args <<< "${LLAMA_ARGS:-}"

run() {  # run PYTHON SCRIPT ARGS...: everything it prints on stderr, its JSON lines into $RESULTS
    "$@" 2>&1 | tee /dev/stderr | { grep '^{' || true; } >> "$RESULTS"
}

for workload in offline latency; do
    if [ "$which" = all ] || [ "$which" = openvino ]; then
        run "$OV_VENV/bin/python" "$HERE/run_openvino.py" --model "$OV_MODEL" --workload "$workload" "$@" ${ov_args[@]+"${ov_args[@]}"}
    fi
    if [ "$which" = all ] || [ "$which" = llamacpp ]; then
        run "$LLAMA_VENV/bin/python" "$HERE/run_llamacpp.py" --workload "$workload" "$@" ${llama_args[@]+"${llama_args[@]}"}
    fi
done
echo "JSON lines in $RESULTS" >&2
