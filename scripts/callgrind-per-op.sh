#!/usr/bin/env bash
# User-space instructions per durable SET of one build, exact on a busy machine (issue 13):
#
#   scripts/callgrind-per-op.sh LABEL SERVER_BINARY [LOADGEN_BINARY] [REQUESTS]
#
# The server runs under `valgrind --tool=callgrind`; after a warm-up of 500 SETs (50 clients × 1,
# 64-byte values, `--fsync always`, as cpu-per-op.sh's set-c50) the counters are zeroed
# (`callgrind_control -z`), REQUESTS (default 2000) SETs run, and the counters are dumped
# (`callgrind_control -d`). Prints the instructions per SET; the dump ($OUT/LABEL/cg.out.1) gives the
# split by function (`callgrind_annotate --inclusive=yes`). Valgrind hides SHA-NI, so the request
# id's SHA-256 counts several times what it costs on the real CPU.
#
# With CHAIN_OF_ONE=1 the server is a one-member cluster (`--node-id 1 --peers 1=...`; decision
# 0064), and the warm-up waits until the cluster formed. MIX, CONNECTIONS and INFLIGHT change the
# load (defaults set=100, 50, 1; `MIX=set=50,get=50 CONNECTIONS=16 INFLIGHT=8` is cpu-per-op.sh's
# ss-16x8), the figure then being instructions per request.
#
# A SERVER_BINARY named `redis-server` runs Redis 7 instead (`appendfsync always`, driven by
# `redis-benchmark -t set -c 50 -d 64 -r 10000`, the anchor of cpu-per-op.sh's redis-set-c50): the
# same count for the reference.
set -uo pipefail
cd "$(dirname "$0")/.."
# Not resolved for redis-server: Redis's binaries are one, chosen by the name it is run as.
label=$1; bin=$2; [ "$(basename "$bin")" = redis-server ] || bin=$(realpath "$bin"); shift 2
gen="$bin"
if [ $# -gt 0 ] && [ -x "$1" ]; then gen=$(realpath "$1"); shift; fi
n=${1:-2000}
OUT="${OUT:-target/bench-results/callgrind}"; dir="$OUT/$label"; rm -rf "$dir"; mkdir -p "$dir"
. scripts/lib/ports.sh
port=$(free_port)
if [ "$(basename "$bin")" = redis-server ]; then
  mkdir -p "$dir/data"
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "$bin" --port "$port" --bind 127.0.0.1 \
    --dir "$dir/data" --appendonly yes --appendfsync always --save '' >"$dir/server.log" 2>&1 &
  load() { redis-benchmark -p "$port" -t set -c 50 -d 64 -r 10000 -q -n "$1"; }
else
  cluster=()
  if [ "${CHAIN_OF_ONE:-0}" = 1 ]; then
    cport=$(free_port)
    cluster=(--node-id 1 --cluster-listen "127.0.0.1:$cport" --peers "1=127.0.0.1:$cport")
  fi
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "$bin" serve --listen "127.0.0.1:$port" \
    --data-dir "$dir/data" --fsync always "${cluster[@]}" >"$dir/server.log" 2>&1 &
  load() { "$gen" bench --port "$port" --connections "${CONNECTIONS:-50}" --inflight "${INFLIGHT:-1}" \
    --mix "${MIX:-set=100}" --keys 10000 --value-size 64 --requests "$1"; }
fi
vpid=$!
trap 'kill $vpid 2>/dev/null; wait $vpid 2>/dev/null; rm -rf "$dir/data"' EXIT
wait_port "$port" 1200
if [ "${CHAIN_OF_ONE:-0}" = 1 ]; then # formed: a write goes through its chain
  for _ in $(seq 600); do
    "$gen" set --port "$port" --timeout 5 bench-ready ok >/dev/null 2>&1 && break
    sleep 0.2
  done
fi
load 500 >/dev/null 2>&1
callgrind_control -z "$vpid" >/dev/null
load "$n" >"$dir/bench.out" 2>&1
callgrind_control -d "$vpid" >/dev/null
ir=$(callgrind_annotate "$dir/cg.out.1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
printf '%s\tinstructions/op %d\n' "$label" "$((ir / n))"
