#!/usr/bin/env bash
# Where the CPU of a durable SET on three nodes goes (docs/benchmarks.md, issue 15): three nodes as in
# scripts/bench-cluster.sh, warmed up, then N durable SETs (50 clients spread over the nodes) with
#   perf      perf record -F 499 -g on the three servers at once ($OUT/perf.data)
#   strace    strace -c -f on each server ($OUT/strace.PID)
#   perfstat  instructions, context switches, migrations of the three servers ($OUT/perfstat.txt)
#   none      nothing attached
# and prints the servers' and the load generators' CPU per operation. Further flags go to
# `mqstate bench` (e.g. --keys-at-head).
#
#   scripts/profile-cluster.sh MQSTATE_BINARY perf|strace|perfstat|none N [bench flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
MQSTATE=$(realpath "$1"); MODE=$2; N=$3; shift 3
OUT="${OUT:-target/bench-results/profile}"; mkdir -p "$OUT"
. scripts/lib/ports.sh
PIDS=(); DIRS=()
stop_all() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null && wait "$p" 2>/dev/null || true; done; for d in "${DIRS[@]:-}"; do [ -n "$d" ] && rm -rf "$d"; done; }
trap stop_all EXIT
cports=(); PORTS=(); SERVERS=(); peers=""
for i in 1 2 3; do PORTS+=("$(free_port)"); cports+=("$(free_port)"); done
for i in 1 2 3; do peers+="${peers:+,}$i=127.0.0.1:${cports[$((i - 1))]}"; done
for i in 1 2 3; do
  dir=$(mktemp -d); DIRS+=("$dir")
  "$MQSTATE" serve --listen "127.0.0.1:${PORTS[$((i - 1))]}" --data-dir "$dir" --fsync always \
    --node-id "$i" --cluster-listen "127.0.0.1:${cports[$((i - 1))]}" --peers "$peers" >"$OUT/n$i.log" 2>&1 &
  SERVERS+=("$!"); PIDS+=("$!")
done
for i in 0 1 2; do wait_port "${PORTS[$i]}"; done
for i in 0 1 2; do for t in $(seq 300); do "$MQSTATE" set --port "${PORTS[$i]}" --timeout 2 "ready-$i" ok >/dev/null 2>&1 && break; sleep 0.2; done; done
# warm-up
wp=(); for i in 0 1 2; do "$MQSTATE" bench --port "${PORTS[$i]}" --connections 17 --requests 3000 --inflight 1 --mix set=100 --keys 10000 --value-size 64 "$@" >/dev/null 2>&1 & wp+=($!); done; for p in "${wp[@]}"; do wait $p || true; done
sleep 1
cpu_us() { awk -v tck="$(getconf CLK_TCK)" '{printf "%d", ($14 + $15) * 1000000 / tck}' "/proc/$1/stat"; }
cpu_sum() { local t=0 p; for p in "$@"; do t=$((t + $(cpu_us "$p"))); done; echo "$t"; }
tracer=()
case $MODE in
  perf) perf record -F 499 -g -o $OUT/perf.data -p "$(IFS=,; echo "${SERVERS[*]}")" >/dev/null 2>&1 & tracer=($!) ;;
  strace) for p in "${SERVERS[@]}"; do strace -c -f -p "$p" -o "$OUT/strace.$p" & tracer+=($!); done ;;
  perfstat) perf stat -e instructions,context-switches,cpu-migrations -p "$(IFS=,; echo "${SERVERS[*]}")" -o $OUT/perfstat.txt & tracer=($!) ;;
esac
sleep 1
before=$(cpu_sum "${SERVERS[@]}"); t0=$(date +%s.%N)
bp=()
for i in 0 1 2; do
  /usr/bin/time -f '%U %S' -o $OUT/bench.$i.time "$MQSTATE" bench --port "${PORTS[$i]}" --connections $((i < 2 ? 17 : 16)) --requests $((N / 3)) --inflight 1 --mix set=100 --keys 10000 --value-size 64 --json $OUT/bench.$i.json "$@" > $OUT/bench.$i.txt 2>&1 & bp+=($!)
done
for p in "${bp[@]}"; do wait $p; done
after=$(cpu_sum "${SERVERS[@]}"); t1=$(date +%s.%N)
for p in "${tracer[@]:-}"; do [ -n "$p" ] && kill -INT $p 2>/dev/null; done
for p in "${tracer[@]:-}"; do [ -n "$p" ] && wait $p 2>/dev/null || true; done
client=$(awk '{t += ($1 + $2) * 1000000} END {printf "%d", t}' $OUT/bench.*.time)
total=$(( (N / 3) * 3 ))
python3 - "$((after-before))" "$client" "$total" "$t0" "$t1" $OUT/bench.*.json <<'PY'
import json,sys
s,c,n,t0,t1=int(sys.argv[1]),int(sys.argv[2]),int(sys.argv[3]),float(sys.argv[4]),float(sys.argv[5])
runs=[json.load(open(f)) for f in sys.argv[6:]]
err=sum(sum(r["errors"].values()) for r in runs)
print(f"{n} SETs in {t1-t0:.1f}s ({n/(t1-t0):,.0f}/s)  p99 {max(r['p99_us'] for r in runs)/1000:.1f} ms  server {s/n:.1f} µs/op  client {c/n:.1f} µs/op  errors {err}")
PY
echo "server pids ${SERVERS[*]}"
