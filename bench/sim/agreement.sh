#!/usr/bin/env bash
# The simulator against the real mesh on this machine: one slice of the Mooncake trace
# replayed on a real two-prefill, two-decode mesh (`kvmesh bench trace`: etcd, a router and
# four node processes of one compute thread each, on loopback) and simulated with a timing
# profile `kvmesh profile` measures here first, the four nodes sharing this machine's cores as
# the real processes do. Prints TTFT p50 and throughput of both and their ratios
# (docs/sim.md reports them), for each round and for the rounds' medians: on a shared two-core
# machine one real replay's TTFT p50 moves by about 15% from run to run, so one round alone
# says as much about the machine as about the simulator.
#
# Usage: bench/sim/agreement.sh [--rounds N] [--quick] [--requests N] [--rate R]
#                               [--conversations N] [--host-cores C] [--out DIR] [--kvmesh BIN]
#   --rounds N         rounds of profile, real replay and simulation (default 3)
#   --quick            a small profile grid (seconds instead of about 30 s; the test suite's)
#   --requests N       the slice's length (default 60)
#   --rate R           requests per second the trace is paced at, its bursts kept (default 1)
#   --conversations N  N whole multi-turn conversations instead of the trace's first requests
#   --host-cores C     the cores the simulated nodes share (default: this machine's)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
KVMESH="$ROOT/target/release/kvmesh"
OUT="$ROOT/target/sim-agreement"
ROUNDS=3
PROFILE_ARGS=(--threads 1)
REQUESTS=60
RATE=1
CONVERSATIONS=""
CORES="$(nproc)"
while (($#)); do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --quick) PROFILE_ARGS+=(--quick); shift ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --rate) RATE="$2"; shift 2 ;;
    --conversations) CONVERSATIONS="$2"; shift 2 ;;
    --host-cores) CORES="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --kvmesh) KVMESH="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
((ROUNDS >= 1)) || { echo "--rounds must be at least 1" >&2; exit 2; }
[[ -x "$KVMESH" ]] || (cd "$ROOT" && cargo build --release -p kvmesh)
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" >&2; }

WORKLOAD="mooncake,scale=32"
TRACE_ARGS=(--limit "$REQUESTS")
if [[ -n "$CONVERSATIONS" ]]; then
  WORKLOAD="$WORKLOAD,conversations=$CONVERSATIONS"
  TRACE_ARGS+=(--conversations "$CONVERSATIONS")
fi

for ((round = 1; round <= ROUNDS; round++)); do
  dir="$OUT/round$round"
  mkdir -p "$dir"
  log "round $round of $ROUNDS: profiling this machine's engine on one thread"
  "$KVMESH" profile "${PROFILE_ARGS[@]}" --out "$dir/cpu.json" >"$dir/profile.txt"
  log "round $round: replaying $REQUESTS requests on a real 2+2 mesh at $RATE req/s"
  "$KVMESH" bench trace --policies kv_aware "${TRACE_ARGS[@]}" --rate "$RATE" --node-threads 1 \
    --json --requests-csv "$dir/real.csv" >"$dir/real.json"
  log "round $round: simulating the same requests on 2+2 nodes sharing $CORES cores"
  "$KVMESH" sim --profile "$dir/cpu.json" --prefill-nodes 2 --decode-nodes 2 \
    --host-cores "$CORES" --link same_host --workload "$WORKLOAD" --load "trace:rate=$RATE" \
    --requests "$REQUESTS" --plots none --out "$dir/sim" --json >"$dir/sim.json"
done

python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
names = ["requests completed", "TTFT p50 (s)", "TTFT p99 (s)", "E2E p50 (s)",
         "throughput (req/s)", "prefix hits"]
def pairs(n):
    real = json.load(open(f"{out}/round{n}/real.json"))["kv_aware"]
    sim = json.load(open(f"{out}/round{n}/sim.json"))["points"][0]["slo"]
    return [
        (real["completed"], sim["ok"]),
        (real["ttft_p50_s"], sim["ttft"]["p50"]),
        (real["ttft_p99_s"], sim["ttft"]["p99"]),
        (real["e2e_p50_s"], sim["e2e"]["p50"]),
        (real["request_rate"], sim["request_throughput"]),
        (real["prefix_hit_rate"], sim["cached_tokens"] / sim["prompt_tokens"]),
    ]
def table(title, rows):
    print(f"{title:20} {'real':>9} {'simulated':>10} {'sim/real':>9}")
    for name, (r, s) in zip(names, rows):
        print(f"{name:20} {r:9.3f} {s:10.3f} {s / r if r else float('nan'):9.2f}")
    print()
each = [pairs(n) for n in range(1, rounds + 1)]
for n, rows in enumerate(each, 1):
    table(f"round {n}", rows)
if rounds > 1:
    table(f"median of {rounds}", [
        tuple(statistics.median(e[i][k] for e in each) for k in (0, 1))
        for i in range(len(names))
    ])
EOF
