#!/usr/bin/env bash
# Issue 15's serving figures, for a machine with both cores idle.
#
#   bash scripts/bench_serving.sh            # the real run (each part ~4 min at most)
#   bash scripts/bench_serving.sh smoke      # a tiny check that everything runs (core 1, ~3 min)
#
# (a) engine core process: `kvflow bench serve` at saturation (all requests at once, streaming)
#     against `kvflow bench throughput` on the same draw, split process vs --in-process-engine,
#     plus TTFT/ITL percentiles at 2 and 4 requests/s (fresh draws: seeds 1 and 2).
# (b) disaggregation: `kvflow bench disagg`, decode streams' p99 ITL while 2,000-token prompts
#     arrive, colocated (one instance on both cores) vs one prefill + one decode instance (one
#     core each), with the KV bytes and ms moved per long prompt.
# Model: `make serve`'s default (the shipped SmolLM2 GGUF, --dtype auto); set MODEL_ARGS to change.
# Env: KVFLOW_ROOT (the checkout to run, default /work/main), PYTHON (default its .venv), CPUS (default 0,1), OUT.
set -euo pipefail

ROOT=${KVFLOW_ROOT:-/work/main}
PY=${PYTHON:-$ROOT/.venv/bin/python}
CPUS=${CPUS:-0,1}
MODEL_ARGS=${MODEL_ARGS:-}
OUT=${OUT:-/tmp/bench_serving.$(date -u +%Y%m%dT%H%M%S)}
MODE=${1:-full}
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

if [ "$MODE" = smoke ]; then
  CPUS=1
  SHAPE="--num-prompts 4 --input-len-min 16 --input-len-max 48 --output-len-min 8 --output-len-max 16"
  DISAGG="--num-streams 2 --stream-output-len 48 --num-long 2 --long-len 300 --long-output-len 2 --long-interval-s 0.5"
  BATCH=128
else
  SHAPE="--num-prompts 32"   # W-offline's shape: inputs 32-512, outputs 32-256 tokens
  DISAGG="--num-streams 4 --stream-output-len 256 --num-long 6 --long-len 2000 --long-output-len 8 --long-interval-s 3"
  BATCH=512
fi
NCPU=$(echo "$CPUS" | tr ',' '\n' | wc -l)
KV="$PY -m kvflow.entrypoints.cli"
echo "kvflow $(git rev-parse --short HEAD) on $(lscpu | grep -m1 'CPU family' | tr -s ' '); cpus $CPUS; results in $OUT"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_health() {  # url pid
  for _ in $(seq 1 600); do
    if ! kill -0 "$2" 2>/dev/null; then echo "kvflow serve exited; see $OUT/serve.log" >&2; exit 1; fi
    if curl -sf "$1/health" >/dev/null; then return 0; fi
    sleep 0.5
  done
  echo "kvflow serve did not start" >&2; exit 1
}

# ---- (a) engine core process vs in-process, saturation and fixed rates ----------------------------
t0=$(date +%s)
taskset -c "$CPUS" $KV bench throughput $MODEL_ARGS --num-threads "$NCPU" $SHAPE --dataset-seed 0 --no-progress \
  --output "$OUT/offline.json" > "$OUT/offline.log" 2>&1
tables=()
for server in split in-process; do
  port=$(free_port)
  extra=""; [ "$server" = in-process ] && extra="--in-process-engine"
  taskset -c "$CPUS" $KV serve $MODEL_ARGS --num-threads "$NCPU" --port "$port" --uvicorn-log-level warning $extra \
    > "$OUT/serve-$server.log" 2>&1 &
  pid=$!
  wait_health "http://127.0.0.1:$port" "$pid"
  for rate in inf 2 4; do
    seed=0; [ "$rate" = 2 ] && seed=1; [ "$rate" = 4 ] && seed=2
    taskset -c "$CPUS" $KV bench serve --base-url "http://127.0.0.1:$port" $SHAPE --request-rate "$rate" \
      --dataset-seed "$seed" --no-progress --output "$OUT/serve-$server-$rate.json" > "$OUT/serve-$server-$rate.log" 2>&1
    tables+=("$server=$OUT/serve-$server-$rate.json")
  done
  kill -TERM "$pid"; wait "$pid" || true
done
echo
echo "## (a) engine core process ($(( $(date +%s) - t0 )) s)"
"$PY" scripts/serving_table.py "$OUT/offline.json" "${tables[@]}" | tee "$OUT/a.md"

# ---- (b) disaggregation on the mixed workload -------------------------------------------------
t0=$(date +%s)
echo
echo "## (b) disaggregation, --max-num-batched-tokens $BATCH on every instance"
taskset -c "$CPUS" $KV bench disagg --cpus "$CPUS" $DISAGG --serve-args "$MODEL_ARGS --max-model-len 4096 --max-num-batched-tokens $BATCH" \
  --output "$OUT/disagg.json" | tee "$OUT/b.md"
echo "($(( $(date +%s) - t0 )) s)"
