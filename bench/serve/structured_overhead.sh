#!/usr/bin/env bash
# Structured outputs' cost and fast-forward's gain, through `kvmesh serve` and the load
# generator, in one command.
#
# Usage: bench/serve/structured_overhead.sh [options]
#   --rounds N        interleaved rounds (default: 3); the medians over rounds are printed
#   --concurrency L   comma-separated concurrencies (default: 1,32)
#   --requests N      requests per measurement and concurrency (default: 4 per request in
#                     flight, at least 16)
#   --input N         prompt tokens (default: 128)
#   --output N        tokens per answer in the overhead measurement (default: 64)
#   --out DIR         logs and reports (default: target/bench-structured)
#   --wait-idle S     first wait up to S s for the 1-min load average to drop below 0.5
#   -h, --help
# Environment: KVMESH_BIN (default target/release/kvmesh; built when missing),
#   KVMESH_SERVE_ARGS (extra arguments for both servers, word-split).
#
# Two servers run on free loopback ports, `kvmesh serve` as configured by default (A) and
# with `[engine] grammar_fast_forward = false` (B); each measurement is
#   kvmesh bench serve --url URL --workload synthetic:input=I,output=O --load concurrency:C \
#     --requests N [--extra-body '{"response_format": ...}'] --json
# and the order of the compared measurements alternates from round to round.
#
# Overhead: free text (A) vs a JSON schema whose one string field must run past the answer
# (minLength 4000), so both give exactly O tokens (ignore_eos): mean ITL (every gap between
# tokens) and TPOT p50, the JSON/free ratio. On B every JSON token is drawn under a mask (the
# masks' whole cost); on A the few tokens of `{"text": "` are forced (gaps near zero).
# Fast-forward (A vs B): a JSON schema with four long fixed keys, greedy, up to 200 tokens,
# ending where the schema ends: mean E2E and tokens per answer, ratio A/B.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
log() { echo "[structured] $*" >&2; }
# shellcheck source=lib.sh
source "$HERE/lib.sh"

ROUNDS=3 CONC=1,32 REQUESTS="" INPUT=128 OUTPUT=64 OUT="$ROOT/target/bench-structured" IDLE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --concurrency) CONC="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --input) INPUT="$2"; shift 2 ;;
    --output) OUTPUT="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --wait-idle) IDLE="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) log "unknown option $1"; exit 2 ;;
  esac
done
mkdir -p "$OUT"
kvmesh_binary
wait_idle "$IDLE"

PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap stop_all EXIT

# start NAME CONFIG_TOML: a server; sets URL_<NAME>.
start() {
  local port; port="$(free_port)"
  printf '%s\n' "$2" >"$OUT/$1.toml"
  # shellcheck disable=SC2086
  "$KVMESH" serve --config "$OUT/$1.toml" --listen "127.0.0.1:$port" ${KVMESH_SERVE_ARGS:-} >"$OUT/$1.log" 2>&1 &
  PIDS+=($!); SERVER_PID=$!
  wait_ready "http://127.0.0.1:$port/health" "$OUT/$1.log"
  printf -v "URL_$1" '%s' "http://127.0.0.1:$port"
}
start A ''
start B $'[engine]\ngrammar_fast_forward = false'

STRING='{"response_format": {"type": "json_schema", "json_schema": {"name": "essay", "schema":
  {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}}}}'
KEYS='{"temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "account", "schema":
  {"type": "object", "additionalProperties": false, "properties": {
    "customer_full_legal_name": {"type": "string", "maxLength": 24},
    "customer_primary_email_address": {"type": "string", "maxLength": 24},
    "preferred_contact_method_for_notifications": {"enum": ["email", "phone", "post"]},
    "account_balance_in_euro_cents": {"type": "integer", "minimum": 0, "maximum": 100000}},
   "required": ["customer_full_legal_name", "customer_primary_email_address",
                "preferred_contact_method_for_notifications", "account_balance_in_euro_cents"]}}}}'

# measure TAG URL C OUTPUT N [bench serve args...]: one measurement's report in $OUT/TAG.json.
measure() {
  local tag="$1" url="$2" c="$3" output="$4" n="$5"; shift 5
  SEED=$(( SEED + 1 ))  # fresh prompts for every measurement: no prefix-cache hits across them
  "${BENCH[@]}" serve --url "$url" --workload "synthetic:input=$INPUT,output=$output" \
    --load "concurrency:$c" --requests "$n" --seed "$SEED" --json --no-progress \
    --plots none --out "$OUT/$tag" "$@" >"$OUT/$tag.json" 2>>"$OUT/bench.log"
}

SEED=0
bench_command
log "warming up (the first constrained request builds the vocabulary's grammar compiler)"
for s in A B; do
  url="URL_$s"
  measure "warm-$s-free" "${!url}" 1 8 2
  measure "warm-$s-json" "${!url}" 1 8 2 --extra-body "$STRING"
done

IFS=, read -ra CS <<<"$CONC"
for r in $(seq 1 "$ROUNDS"); do
  for c in "${CS[@]}"; do
    n="${REQUESTS:-$(( c * 4 > 16 ? c * 4 : 16 ))}"
    order=(free json jsonB ffon ffoff); (( r % 2 == 0 )) && order=(jsonB json free ffoff ffon)
    for kind in "${order[@]}"; do
      log "round $r, concurrency $c: $kind"
      case "$kind" in
        free) measure "r$r-c$c-free" "$URL_A" "$c" "$OUTPUT" "$n" ;;
        json) measure "r$r-c$c-json" "$URL_A" "$c" "$OUTPUT" "$n" --extra-body "$STRING" ;;
        jsonB) measure "r$r-c$c-jsonB" "$URL_B" "$c" "$OUTPUT" "$n" --extra-body "$STRING" ;;
        ffon) measure "r$r-c$c-ffon" "$URL_A" "$c" 200 "$n" --no-ignore-eos --extra-body "$KEYS" ;;
        ffoff) measure "r$r-c$c-ffoff" "$URL_B" "$c" 200 "$n" --no-ignore-eos --extra-body "$KEYS" ;;
      esac
    done
  done
done

python3 - "$OUT" "$ROUNDS" "$CONC" <<'EOF'
import json, statistics, sys
out, rounds, concs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
def slo(tag):
    s = json.load(open(f"{out}/{tag}.json"))["points"][0]["slo"]
    assert s["failed"] == 0 and s["ok"] == s["requests"], (tag, s["errors"])
    return s
def med(xs): return statistics.median(xs)
print("overhead (JSON schema / free text, same tokens; medians over rounds):")
print("  conc  server  tokens/answer  ITL mean free -> json (ms)  ratio  (per round)  TPOT p50 ratio")
for c in concs:
    f = [slo(f"r{r}-c{c}-free") for r in range(1, rounds + 1)]
    for server, kind in (("A", "json"), ("B", "jsonB")):
        j = [slo(f"r{r}-c{c}-{kind}") for r in range(1, rounds + 1)]
        assert all(a["output_tokens"] == b["output_tokens"] for a, b in zip(f, j))
        ratios = [b["itl"]["mean"] / a["itl"]["mean"] for a, b in zip(f, j)]
        tpot = med([b["tpot"]["p50"] / a["tpot"]["p50"] for a, b in zip(f, j)])
        print(f"  {c:>4}  {server:>6}  {f[0]['output_tokens'] // f[0]['ok']:>13}  "
              f"{med([a['itl']['mean'] for a in f]) * 1e3:>8.2f} -> {med([b['itl']['mean'] for b in j]) * 1e3:<8.2f}  "
              f"{med(ratios):.3f}  ({', '.join(f'{x:.3f}' for x in ratios)})  {tpot:.3f}")
print("fast-forward (schema with long fixed keys, on / off; medians over rounds):")
print("  conc  tokens/answer on, off  E2E mean on -> off (ms)  ratio  (per round)")
for c in concs:
    on = [slo(f"r{r}-c{c}-ffon") for r in range(1, rounds + 1)]
    off = [slo(f"r{r}-c{c}-ffoff") for r in range(1, rounds + 1)]
    ratios = [a["e2e"]["mean"] / b["e2e"]["mean"] for a, b in zip(on, off)]
    tok = lambda s: s["output_tokens"] / s["ok"]
    print(f"  {c:>4}  {med([tok(s) for s in on]):>9.1f}, {med([tok(s) for s in off]):<6.1f}  "
          f"{med([s['e2e']['mean'] for s in on]) * 1e3:>8.0f} -> {med([s['e2e']['mean'] for s in off]) * 1e3:<8.0f}  "
          f"{med(ratios):.3f}  ({', '.join(f'{x:.3f}' for x in ratios)})")
EOF
