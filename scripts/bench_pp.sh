#!/usr/bin/env bash
# Issue 14's targets back to back, on the default model (SmolLM2-135M) in bf16:
#   W-offline T=1 on 2 threads, P=2 with one thread per rank (mp; ray too when it is installed),
#   then `kvflow bench collectives` (2 ranks, one thread each), and a compact table with P=2 / T=1.
#
#   scripts/bench_pp.sh                     # the real run: give it both cores (CPUS=0,1), quiet machine
#   SMOKE=1 CPUS=1 scripts/bench_pp.sh      # a few requests pinned to core 1: checks the script only
#
# Environment: REPO (the tree to run: default the checkout this script is in, else /work/main),
# PY (its python, default REPO/.venv/bin/python), CPUS (taskset list,
# default 0,1), SMOKE (1: 4 requests, no warm-up, 20 collective calls), RAY (0: skip the ray run),
# RESULTS (a directory for the JSON, default a fresh temporary one), RAY_TIMEOUT (seconds, default 600).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${REPO:-}" ]; then
    if [ -d "$HERE/kvflow/distributed" ]; then REPO=$HERE; else REPO=/work/main; fi
fi
PY=${PY:-$REPO/.venv/bin/python}
CPUS=${CPUS:-0,1}
SMOKE=${SMOKE:-0}
RAY=${RAY:-1}
RAY_TIMEOUT=${RAY_TIMEOUT:-600}
RESULTS=${RESULTS:-$(mktemp -d /tmp/bench_pp.XXXXXX)}
mkdir -p "$RESULTS"
cd "$REPO"
export PYTHONPATH=$REPO KVFLOW_WORKER_MULTIPROC_METHOD=${KVFLOW_WORKER_MULTIPROC_METHOD:-spawn}
if [ "$SMOKE" = 1 ]; then
    export KVFLOW_OVERSUBSCRIBE=1  # both ranks on one core
    W=(--num-prompts 4 --warmup-seed -1)
    COLL=(--iters 20 --tokens 1,32)
else
    W=()
    COLL=(--iters 1000 --tokens 1,8,32,256,2048)
fi
PREFIX=()  # e.g. (timeout 600) for the ray run
kvflow() { "${PREFIX[@]}" taskset -c "$CPUS" "$PY" -m kvflow.entrypoints.cli "$@"; }

echo "# bench_pp: $(date -u +%FT%TZ), $(lscpu | grep -m1 'CPU family' | tr -s ' '), cores $CPUS, smoke=$SMOKE, $REPO @ $(git rev-parse --short HEAD)"
echo "# load average: $(cut -d' ' -f1-3 /proc/loadavg)"
run_w() {  # name, then the layout's options
    local name=$1; shift
    local t0=$SECONDS
    echo "## $name: kvflow bench throughput --dtype bfloat16 $* ${W[*]} --no-progress"
    if OMP_NUM_THREADS=1 kvflow bench throughput --dtype bfloat16 "$@" "${W[@]}" --no-progress \
            --output "$RESULTS/$name.json" > "$RESULTS/$name.log" 2>&1; then
        tail -n 4 "$RESULTS/$name.log"
    else
        echo "   failed (exit $?); last lines:"; tail -n 15 "$RESULTS/$name.log"
    fi
    echo "   ($((SECONDS - t0)) s wall, start-up included)"
}
run_w t1 --num-threads 2
run_w pp2_mp -pp 2 --num-threads 1 --distributed-executor-backend mp
if [ "$RAY" = 1 ] && "$PY" -c "import ray" 2>/dev/null; then
    PREFIX=(timeout "$RAY_TIMEOUT")  # a local Ray cluster, started on demand (RAY_ADDRESS unset)
    RAY_ADDRESS= run_w pp2_ray -pp 2 --num-threads 1 --distributed-executor-backend ray
    PREFIX=()
else
    echo "## pp2_ray: skipped (RAY=0 or ray not installed: pip install 'kvflow[ray]')"
fi
echo "## collectives: kvflow bench collectives --dtype bfloat16 ${COLL[*]}"
kvflow bench collectives --dtype bfloat16 "${COLL[@]}" --json "$RESULTS/collectives.json" > "$RESULTS/collectives.log" 2>&1 \
    || { echo "   failed:"; tail -n 15 "$RESULTS/collectives.log"; }

"$PY" - "$RESULTS" <<'EOF'
import json, os, sys

results = sys.argv[1]

def load(name):
    try:
        with open(os.path.join(results, f"{name}.json")) as f:
            return json.load(f)["result"]
    except (OSError, KeyError, ValueError):
        return None

base = load("t1")
print(f"\n{'layout':<24} {'total tok/s':>12} {'output tok/s':>13} {'vs T=1':>8}")
for name, label in (("t1", "T=1, 2 threads"), ("pp2_mp", "P=2 mp, 1 thread/rank"), ("pp2_ray", "P=2 ray, 1 thread/rank")):
    r = load(name)
    if r is None:
        print(f"{label:<24} {'-':>12} {'-':>13} {'-':>8}")
        continue
    ratio = f"{r['total_tokens_per_s'] / base['total_tokens_per_s']:.2f}x" if base else "-"
    print(f"{label:<24} {r['total_tokens_per_s']:>12.1f} {r.get('output_tokens_per_s', float('nan')):>13.1f} {ratio:>8}")
print("(target: P=2 at least 0.85x T=1)")
try:
    with open(os.path.join(results, "collectives.json")) as f:
        rows = json.load(f)
    print(f"\n{'tokens':>7} {'all-reduce bytes':>17} {'gloo us':>9} {'shm us':>8} {'send bytes':>11} {'send us':>9}")
    for r in rows:
        shm = r.get("shm_all_reduce_us")
        shm = "-" if shm is None else f"{shm:.1f}"
        print(f"{r['tokens']:>7} {r['bytes']:>17,} {r['all_reduce_us']:>9.1f} {shm:>8} {r['send_recv_bytes']:>11,} {r['send_recv_us']:>9.1f}")
except (OSError, ValueError):
    print("\ncollectives: no result")
print(f"\nJSON and logs in {results}")
EOF
