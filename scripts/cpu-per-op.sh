#!/usr/bin/env bash
# Server CPU time per request of one build, for a machine too busy for wall-clock rates:
#
#   scripts/cpu-per-op.sh LABEL SERVER_BINARY [LOADGEN_BINARY] WORKLOAD...
#   WORKLOAD = set-c50 | ss-16x8 | ss-64x16 | pubsub | restart | restart-nosnap | redis-set-c50
#
# `redis-set-c50` is the anchor of issue 13: Redis 7 (`redis-server`, `appendfsync always`) driven by
# `redis-benchmark -t set -c 50 -d 64 -r 10000`, the same shape as set-c50 (LABEL and the binaries are
# then only names in the output). With SYSCALLS=1 the server runs under `strace -c -f` during the
# counted requests and the system calls per request are printed too (strace slows the server down
# several times over: take CPU per request from a run without it).
#
# Each workload runs a fixed number of requests after a warm-up of a tenth of them; CPU is the
# server's utime + stime (/proc/PID/stat, CLK_TCK ticks) over the counted requests. `restart` loads
# 1,000,000 keys (as scripts/bench.sh restart), stops the server, and reports the restarted server's
# CPU seconds and VmRSS once it listens; `restart-nosnap` does the same with snapshots off, so every
# record is replayed (the default threshold makes the figure depend on where the last snapshot falls).
# With THREADS=1 each server workload also prints its CPU and context switches per request by thread
# name (runtime workers, log writer, ...): where a change moves work between threads (decision 0056).
# With CHAIN_OF_ONE=1 the server is a one-member cluster (`--node-id 1 --peers 1=...`): the state
# store's keys on chains of one, the same binary's other path (issue 15, decision 0064).
# One line per workload goes to $OUT/results.tsv. Alternate builds in a loop for side-by-side figures.
set -uo pipefail
cd "$(dirname "$0")/.."
label=$1; bin=$(realpath "$2"); shift 2
gen="$bin"
if [ $# -gt 0 ] && [ -x "$1" ]; then gen=$(realpath "$1"); shift; fi
OUT="${OUT:-target/bench-results/cpu-per-op}"; mkdir -p "$OUT"
. scripts/lib/ports.sh
# Context switches (voluntary + involuntary) of every thread of PID: each is a thread going to sleep
# or being put off its core, so hand-offs between threads show up here.
ctx() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ {s += $2} END {print s}'; }
# "name ticks switches" for every thread of PID (thread names may repeat: summed by `per_thread`).
threads() { for t in /proc/"$1"/task/*; do
  printf '%s %s %s\n' "$(tr ' ' _ <"$t/comm")" "$(awk '{print $14 + $15}' "$t/stat")" \
    "$(awk '/ctxt_switches/ {s += $2} END {print s}' "$t/status")"; done 2>/dev/null; }
per_thread() { # name label n before after
  awk -v n="$3" -v tck="$(getconf CLK_TCK)" -v name="$1" -v label="$2" '
    NR == FNR { c[$1] += $2; x[$1] += $3; next } { cc[$1] += $2; xx[$1] += $3 }
    END { line = sprintf("%s\t%s\tthreads", name, label)
          for (t in cc) if (cc[t] > c[t]) line = line sprintf("\t%s cpu_us/op %.2f ctxsw/op %.2f", t,
            (cc[t] - c[t]) * 1000000 / tck / n, (xx[t] - x[t]) / n); print line }' "$4" "$5" | tee -a "$OUT/results.tsv"
}
cpu_us() { awk -v tck="$(getconf CLK_TCK)" '{printf "%d", ($14 + $15) * 1000000 / tck}' "/proc/$1/stat"; }
start() {
  PORT=$(free_port); DATA=$(mktemp -d -p "${TMPDIR:-/tmp}" mqstate-cpu.XXXXXX)
  local cluster=()
  if [ "${CHAIN_OF_ONE:-0}" = 1 ]; then
    local cport; cport=$(free_port)
    cluster=(--node-id 1 --cluster-listen "127.0.0.1:$cport" --peers "1=127.0.0.1:$cport")
  fi
  "$bin" serve --listen "127.0.0.1:$PORT" --data-dir "$DATA" "${cluster[@]}" "$@" >>"$OUT/server-$label.log" 2>&1 &
  SPID=$!; wait_port "$PORT" 300
  if [ "${CHAIN_OF_ONE:-0}" = 1 ]; then # formed: a write goes through its chain
    local tries
    for tries in $(seq 300); do
      "$gen" set --port "$PORT" --timeout 2 bench-ready ok >/dev/null 2>&1 && break
      sleep 0.1
    done
  fi
}
stop() { kill "$SPID" 2>/dev/null; wait "$SPID" 2>/dev/null; rm -rf "$DATA"; }
trap stop EXIT
# strace -c -f of the server while "$@" runs; prints system calls per request (of n) by kind.
syscalls() { # name n command...
  local name=$1 n=$2; shift 2
  local trace="$OUT/strace-$name-$label.txt"
  strace -c -f -q -p "$SPID" -o "$trace" & local tpid=$!
  sleep 1
  "$@" >/dev/null 2>&1
  kill -INT "$tpid"; wait "$tpid" 2>/dev/null
  awk -v n="$n" -v name="$name" -v label="$label" '
    $1 ~ /^[0-9.]+$/ && NF >= 5 { calls = $4; sc = $NF; if (sc == "total") total = calls; else { per[sc] = calls } }
    END { line = sprintf("%s\t%s\tsyscalls/op %.2f", name, label, total / n);
          for (s in per) if (per[s] / n >= 0.05) line = line sprintf("\t%s %.2f", s, per[s] / n); print line }' "$trace" | tee -a "$OUT/results.tsv"
}
one() { # name requests serve-flags... -- bench-flags...
  local name=$1 n=$2; shift 2
  local sflags=(); while [ "$1" != "--" ]; do sflags+=("$1"); shift; done; shift
  start "${sflags[@]}"
  "$gen" bench --port "$PORT" --requests $((n / 10)) "$@" >/dev/null 2>&1
  if [ "${SYSCALLS:-0}" = 1 ]; then
    syscalls "$name" "$n" "$gen" bench --port "$PORT" --requests "$n" "$@"
    stop; return
  fi
  local c0 x0; c0=$(cpu_us "$SPID"); x0=$(ctx "$SPID")
  [ "${THREADS:-0}" = 1 ] && threads "$SPID" >"$OUT/threads-before"
  "$gen" bench --port "$PORT" --requests "$n" --json "$OUT/$name-$label.json" "$@" >/dev/null 2>&1
  local c1 x1; c1=$(cpu_us "$SPID"); x1=$(ctx "$SPID")
  [ "${THREADS:-0}" = 1 ] && threads "$SPID" >"$OUT/threads-after"
  stop
  printf '%s\t%s\tcpu_us/op %.2f\tctxsw/op %.2f\t%s\n' "$name" "$label" "$(echo "($c1 - $c0) / $n" | bc -l)" \
    "$(echo "($x1 - $x0) / $n" | bc -l)" \
    "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("ops/s %.0f\tp99_ms %.2f\terrors %d" % (d["ops_per_sec"], d["p99_us"] / 1000, sum(d["errors"].values())))' "$OUT/$name-$label.json")" \
    | tee -a "$OUT/results.tsv"
  [ "${THREADS:-0}" = 1 ] && per_thread "$name" "$label" "$n" "$OUT/threads-before" "$OUT/threads-after"
  return 0
}
redis_set() { # name requests
  local name=$1 n=$2
  PORT=$(free_port); DATA=$(mktemp -d -p "${TMPDIR:-/tmp}" redis-cpu.XXXXXX)
  redis-server --port "$PORT" --bind 127.0.0.1 --dir "$DATA" --appendonly yes --appendfsync always \
    --save '' >>"$OUT/redis-$label.log" 2>&1 &
  SPID=$!; wait_port "$PORT"
  local load=(redis-benchmark -p "$PORT" -t set -c 50 -d 64 -r 10000 -q)
  "${load[@]}" -n $((n / 10)) >/dev/null 2>&1
  if [ "${SYSCALLS:-0}" = 1 ]; then
    syscalls "$name" "$n" "${load[@]}" -n "$n"
    stop; return
  fi
  local c0 x0; c0=$(cpu_us "$SPID"); x0=$(ctx "$SPID")
  "${load[@]}" -n "$n" >/dev/null 2>&1
  local c1 x1; c1=$(cpu_us "$SPID"); x1=$(ctx "$SPID")
  stop
  printf '%s\t%s\tcpu_us/op %.2f\tctxsw/op %.2f\n' "$name" "$label" "$(echo "($c1 - $c0) / $n" | bc -l)" \
    "$(echo "($x1 - $x0) / $n" | bc -l)" | tee -a "$OUT/results.tsv"
}
restart() { # name serve-flags...
  local name=$1; shift
  start --fsync never "$@"
  "$gen" bench --port "$PORT" --connections 16 --inflight 64 --mix set=100 --keys 1000000 \
    --distribution sequential --value-size 100 --requests 1000000 >/dev/null 2>&1
  kill -TERM "$SPID"; wait "$SPID"
  "$bin" serve --listen "127.0.0.1:$PORT" --data-dir "$DATA" "$@" >>"$OUT/server-$label.log" 2>&1 &
  SPID=$!; wait_port "$PORT" 300
  local cpu; cpu=$(cpu_us "$SPID")
  local rss; rss=$(awk '/VmRSS/ {print $2}' "/proc/$SPID/status")
  stop
  printf '%s\t%s\tcpu_s %.2f\trss_kB %s\n' "$name" "$label" "$(echo "$cpu / 1000000" | bc -l)" "$rss" | tee -a "$OUT/results.tsv"
}
for w in "$@"; do
  case $w in
    set-c50) one set-c50 40000 --fsync always -- --connections 50 --inflight 1 --mix set=100 --keys 10000 --value-size 64 ;;
    ss-16x8) one ss-16x8 100000 --fsync always -- --connections 16 --inflight 8 --mix set=50,get=50 --keys 10000 --value-size 64 ;;
    ss-64x16) one ss-64x16 100000 --fsync always -- --connections 64 --inflight 16 --mix set=50,get=50 --keys 10000 --value-size 64 ;;
    pubsub) one pubsub-1x100 20000 -- --mode pubsub --publishers 1 --subscribers 100 --qos 1 --payload 64 --inflight 16 ;;
    redis-set-c50) redis_set redis-set-c50 40000 ;;
    restart) restart restart-1m ;;
    restart-nosnap) restart restart-1m-nosnap --snapshot-threshold-bytes 100000000000 ;;
    *) echo "unknown workload $w" >&2; exit 2 ;;
  esac
done
