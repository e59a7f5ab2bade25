#!/usr/bin/env bash
# Two builds of mqstate side by side in one run, alternating, so that both see the same machine:
#
#   scripts/bench-compare.sh BASE_BINARY [NEW_BINARY]      (NEW defaults to a release build made here)
#
# The workloads are the ones a refactoring must not slow down (issue 12): state store 16×8 and 64×16
# with `--fsync always`, durable SET with 50 clients, pub/sub 1 → 100 at QoS 1, and a restart with
# 1,000,000 keys. Each runs ROUNDS times (default 2) per build, base first then new, and one line per
# run goes to $OUT/compare.tsv (workload, build, round, ops/s, p99 ms or seconds to ready).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE="${1:?usage: $0 BASE_BINARY [NEW_BINARY]}"
NEW="${2:-}"
OUT="${OUT:-target/bench-results/compare}"
DURATION="${DURATION:-8}"
WARMUP="${WARMUP:-2}"
ROUNDS="${ROUNDS:-2}"
mkdir -p "$OUT"
if [ -z "$NEW" ]; then
  cargo build --release --quiet
  NEW="$PWD/target/release/mqstate"
fi
BASE="$(realpath "$BASE")"; NEW="$(realpath "$NEW")"

. scripts/lib/ports.sh
SERVER_PID=""
stop() { if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""; fi; }
trap stop EXIT

start() { # binary, extra serve flags...
  local bin="$1"; shift
  PORT=$(free_port); DATA=$(mktemp -d -p "${TMPDIR:-/tmp}" mqstate-compare.XXXXXX)
  "$bin" serve --listen "127.0.0.1:$PORT" --data-dir "$DATA" "$@" >>"$OUT/server.log" 2>&1 &
  SERVER_PID=$!; wait_port "$PORT" 300
}
# The load generator is always the new build: only the server differs between the two columns.
load() { # json file, bench flags...
  local json="$1"; shift
  "$NEW" bench --port "$PORT" --duration "$DURATION" --warmup "$WARMUP" --json "$json" "$@" >/dev/null
}
figure() { # json → "ops/s<TAB>p99 ms"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.0f\t%.2f" % (d["ops_per_sec"], d["p99_us"] / 1000))' "$1"
}
row() { printf '%s\t%s\t%s\t%s\n' "$@" | tee -a "$OUT/compare.tsv"; }

run_workload() { # name, build label, binary, round
  local name="$1" label="$2" bin="$3" round="$4" json="$OUT/$1-$2-$4.json"
  case "$name" in
    ss-16x8)  start "$bin" --fsync always; load "$json" --connections 16 --inflight 8 --mix set=50,get=50 --keys 10000 --value-size 64 ;;
    ss-64x16) start "$bin" --fsync always; load "$json" --connections 64 --inflight 16 --mix set=50,get=50 --keys 10000 --value-size 64 ;;
    set-c50)  start "$bin" --fsync always; load "$json" --connections 50 --inflight 1 --mix set=100 --keys 10000 --value-size 64 ;;
    pubsub-1x100) start "$bin"; load "$json" --mode pubsub --publishers 1 --subscribers 100 --qos 1 --payload 64 --inflight 16 ;;
    restart-1m)
      start "$bin" --fsync never
      "$NEW" bench --port "$PORT" --connections 16 --inflight 64 --mix set=100 --keys 1000000 \
        --distribution sequential --value-size 100 --requests 1000000 >/dev/null
      kill -TERM "$SERVER_PID"; wait "$SERVER_PID" || true
      local t0; t0=$(date +%s.%N)
      "$bin" serve --listen "127.0.0.1:$PORT" --data-dir "$DATA" >>"$OUT/server.log" 2>&1 &
      SERVER_PID=$!; wait_port "$PORT" 300
      local took; took=$(echo "$(date +%s.%N) - $t0" | bc)
      local rss; rss=$(awk '/VmRSS/ {print $2}' "/proc/$SERVER_PID/status")
      stop; rm -rf "$DATA"
      row "$name" "$label" "$round" "ready ${took}s rss ${rss}kB"
      return ;;
  esac
  stop; rm -rf "$DATA"
  row "$name" "$label" "$round" "$(figure "$json")"
}

: >"$OUT/compare.tsv"
echo "base: $BASE" | tee "$OUT/builds.txt"; echo "new:  $NEW" | tee -a "$OUT/builds.txt"
for name in ${WORKLOADS:-ss-16x8 ss-64x16 set-c50 pubsub-1x100 restart-1m}; do
  for round in $(seq "$ROUNDS"); do
    run_workload "$name" base "$BASE" "$round"
    run_workload "$name" new "$NEW" "$round"
  done
done
echo "$OUT/compare.tsv"
