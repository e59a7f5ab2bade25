#!/usr/bin/env bash
# The chains' figures in docs/benchmarks.md (issue 15), side by side in one run: one mqstate node,
# three mqstate nodes on loopback (the state store on chains) and a three-member etcd cluster.
#
#   scripts/bench-cluster.sh [all|single|cluster|cluster-at-head|pubsub|etcd|fsyncs] [MQSTATE_BINARY]   (default: all, the release build)
#
# Workloads (each after a warm-up):
#   set-c50  durable SET, 50 clients × 1 request in flight, 64-byte values, 10,000 keys, `--fsync always`
#   ss-16x8  the 50/50 state-store workload (SET/GET, 16 connections × 8 in flight, 10,000 keys)
#   etcd     put, 50 clients over 50 connections (`benchmark put --clients 50 --conns 50 --val-size 64
#            --key-space-size 10000` in etcd's tool), by our etcd-bench (tools/etcd-bench, decision 0042)
# For the cluster the clients are spread over the three nodes (a bench process per node, its share of
# the connections); rates add up, the p99 reported is the worst of the three. `cluster-at-head` runs
# the cluster's workloads with `--keys-at-head`: each client sends only keys its node heads, so no
# request is forwarded between nodes (the chain alone, not in `all`). `pubsub` (not in `all`): 16
# publishers -> 16 subscribers at QoS 1 (window 1, 64-byte payloads) over the three nodes in turn, so
# each publish is forwarded to the two other nodes; a fixed count of publishes ($PUBLISHES, default
# 100,000) after a tenth of it as warm-up, printed as the servers' CPU per publish and per delivered message (decision 0066).
# Printed per run: ops/s, p50/p99 ms, the servers' CPU per operation (utime+stime of every server
# process over the counted requests), the load generators' CPU per operation apart, and with `fsyncs`
# the fdatasync/fsync calls per write of each node (perf's syscall tracepoints over a fixed count).
# Needs: etcd-server and etcd-client (Debian, etcd 3.4), protobuf-compiler (to build etcd-bench).
# Results go to $OUT (default target/bench-results/cluster). The machine's other load shows in the
# rates: compare CPU per operation and fsyncs per write when it is shared.
set -euo pipefail
cd "$(dirname "$0")/.."

WHAT="${1:-all}"
OUT="${OUT:-target/bench-results/cluster}"
DURATION="${DURATION:-10}"
WARMUP="${WARMUP:-2}"
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
if [ -n "${2:-}" ]; then MQSTATE=$(realpath "$2"); else
  cargo build --release --quiet --bin mqstate; MQSTATE="$TARGET/release/mqstate"; fi
mkdir -p "$OUT"

need_etcd() {
  if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null || ! command -v protoc >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y etcd-server etcd-client protobuf-compiler >/dev/null
  fi
  # Debian's package starts a member on the default ports as a service; ours use their own ports.
  cargo build --release --quiet --manifest-path tools/etcd-bench/Cargo.toml \
    --target-dir "$TARGET/etcd-bench"
  ETCD_BENCH="$TARGET/etcd-bench/release/etcd-bench"
}

. scripts/lib/ports.sh
PIDS=(); DIRS=()
stop_all() {
  local pid
  for pid in "${PIDS[@]:-}"; do if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then wait "$pid" 2>/dev/null || true; fi; done
  PIDS=()
  for d in "${DIRS[@]:-}"; do [ -n "$d" ] && rm -rf "$d"; done
  DIRS=()
}
trap stop_all EXIT

cpu_us() { awk -v tck="$(getconf CLK_TCK)" '{printf "%d", ($14 + $15) * 1000000 / tck}' "/proc/$1/stat"; }
# The load generators' CPU (utime + stime from /usr/bin/time, connecting included), in µs.
client_cpu_us() { awk '{t += ($1 + $2) * 1000000} END {printf "%d", t}' "$@"; }
cpu_sum() { local t=0 p; for p in "$@"; do t=$((t + $(cpu_us "$p"))); done; echo "$t"; }

# ---- mqstate ------------------------------------------------------------------------------------

start_single() {
  local dir; dir=$(mktemp -d); DIRS+=("$dir")
  PORTS=("$(free_port)")
  "$MQSTATE" serve --listen "127.0.0.1:${PORTS[0]}" --data-dir "$dir" --fsync always \
    >"$OUT/single.server.log" 2>&1 &
  SERVERS=("$!"); PIDS+=("$!"); wait_port "${PORTS[0]}"
}

start_cluster() {
  local cports=() i peers=""
  PORTS=(); SERVERS=()
  for i in 1 2 3; do PORTS+=("$(free_port)"); cports+=("$(free_port)"); done
  for i in 1 2 3; do peers+="${peers:+,}$i=127.0.0.1:${cports[$((i - 1))]}"; done
  for i in 1 2 3; do
    local dir; dir=$(mktemp -d); DIRS+=("$dir")
    "$MQSTATE" serve --listen "127.0.0.1:${PORTS[$((i - 1))]}" --data-dir "$dir" --fsync always \
      --node-id "$i" --cluster-listen "127.0.0.1:${cports[$((i - 1))]}" --peers "$peers" \
      >"$OUT/cluster-n$i.server.log" 2>&1 &
    SERVERS+=("$!"); PIDS+=("$!")
  done
  for i in 0 1 2; do wait_port "${PORTS[$i]}"; done
  # Formed: every node answers a write through its chains (the first ones wait for the views).
  local tries
  for i in 0 1 2; do
    for tries in $(seq 300); do
      "$MQSTATE" set --port "${PORTS[$i]}" --timeout 2 "bench-ready-$i" ok >/dev/null 2>&1 && break
      [ "$tries" = 300 ] && { echo "node $((i + 1)) never served a write" >&2; return 1; }
      sleep 0.2
    done
  done
}

# bench NAME TOTAL_CONNECTIONS FLAGS...: one bench process per server port, the connections split
# between them, run together; prints one line and keeps each process's JSON.
bench() {
  local name=$1 conns=$2; shift 2
  local n=${#PORTS[@]} i pids=() share
  local before; before=$(cpu_sum "${SERVERS[@]}")
  for i in $(seq 0 $((n - 1))); do
    share=$(( conns / n + (i < conns % n ? 1 : 0) ))
    /usr/bin/time -f '%U %S' -o "$OUT/$name.$i.time" \
      "$MQSTATE" bench --port "${PORTS[$i]}" --connections "$share" --duration "$DURATION" \
      --warmup "$WARMUP" --json "$OUT/$name.$i.json" "$@" >"$OUT/$name.$i.txt" 2>&1 &
    pids+=("$!")
  done
  for i in "${pids[@]}"; do wait "$i"; done
  local after; after=$(cpu_sum "${SERVERS[@]}")
  # CPU over warm-up and run, divided by every reply (counted ones × (warm-up + run) / run).
  python3 - "$name" "$((after - before))" "$DURATION" "$WARMUP" "$(client_cpu_us "$OUT/$name".*.time)" "$OUT/$name".*.json <<'EOF' | tee -a "$OUT/results.txt"
import json, sys
name, cpu_us, duration, warmup, client_us, files = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6:]
runs = [json.load(open(f)) for f in files]
ops = sum(r["ops_per_sec"] for r in runs)
p50 = max(r["p50_us"] for r in runs) / 1000
p99 = max(r["p99_us"] for r in runs) / 1000
errors = sum(sum(r["errors"].values()) for r in runs)
total = ops * (duration + warmup)
print(f"{name:28} {ops:>10,.0f} ops/s  p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  server cpu {cpu_us / total:6.1f} µs/op  client cpu {client_us / total:5.1f} µs/op  errors {errors}")
EOF
}

SET_C50=(--inflight 1 --mix set=100 --keys 10000 --value-size 64)
SS_16X8=(--inflight 8 --mix set=50,get=50 --keys 10000 --value-size 64)

single() {
  start_single
  bench single-set-c50 50 "${SET_C50[@]}"
  bench single-ss-16x8 16 "${SS_16X8[@]}"
  stop_all
}

cluster() {
  start_cluster
  bench cluster-set-c50 50 "${SET_C50[@]}"
  bench cluster-ss-16x8 16 "${SS_16X8[@]}"
  stop_all
}

cluster_at_head() {
  start_cluster
  bench cluster-head-set-c50 50 "${SET_C50[@]}" --keys-at-head
  bench cluster-head-ss-16x8 16 "${SS_16X8[@]}" --keys-at-head
  stop_all
}

pubsub_of() { # name publishes flags...: one bench process over the three nodes, a fixed count
  local name=$1 n=$2; shift 2
  local servers; servers=$(printf '127.0.0.1:%s,' "${PORTS[@]}"); servers=${servers%,}
  local run=("$MQSTATE" bench --mode pubsub --servers "$servers" "$@")
  "${run[@]}" --requests $((n / 10)) >/dev/null 2>&1
  local before; before=$(cpu_sum "${SERVERS[@]}")
  "${run[@]}" --requests "$n" --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1
  local after; after=$(cpu_sum "${SERVERS[@]}")
  python3 - "$name" "$((after - before))" "$n" "$OUT/$name.json" <<'EOF' | tee -a "$OUT/results.txt"
import json, sys
name, cpu_us, n, run = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.load(open(sys.argv[4]))
delivered = run["replies"].get("delivered", 0)
errors = sum(run["errors"].values())
print(f"{name:28} {n:,} publishes, {delivered:,} delivered, {errors} errors  server cpu "
      f"{cpu_us / n:7.1f} µs/publish  {cpu_us / max(delivered, 1):6.2f} µs/delivered")
EOF
}

pubsub() {
  start_cluster
  pubsub_of cluster-pubsub-16x16 "${PUBLISHES:-100000}" --publishers 16 --subscribers 16 --inflight 1 --qos 1
  stop_all
}

# ---- fsyncs per write (perf's syscall tracepoints; robust to the machine's load) -------------------

fsyncs_of() { # label requests: a fixed number of durable SETs spread over the nodes, fsyncs counted per node
  local label=$1 n=$2 i pids=() perfs=()
  for i in "${!SERVERS[@]}"; do
    perf stat -x, -e 'syscalls:sys_enter_fdatasync,syscalls:sys_enter_fsync' -p "${SERVERS[$i]}" \
      -o "$OUT/$label.perf.$i" 2>/dev/null &
    perfs+=("$!")
  done
  sleep 1
  local each=$(( n / ${#PORTS[@]} ))
  for i in "${!PORTS[@]}"; do
    "$MQSTATE" bench --port "${PORTS[$i]}" --connections $(( 50 / ${#PORTS[@]} )) --requests "$each" \
      "${SET_C50[@]}" >/dev/null 2>&1 &
    pids+=("$!")
  done
  for i in "${pids[@]}"; do wait "$i"; done
  for i in "${perfs[@]}"; do kill -INT "$i"; wait "$i" 2>/dev/null || true; done
  local total=$(( each * ${#PORTS[@]} ))
  for i in "${!SERVERS[@]}"; do
    awk -F, -v label="$label" -v node=$((i + 1)) -v n="$total" '$1 ~ /^[0-9]+$/ {s += $1}
      END {printf "%-20s node %d: %d fsyncs for %d writes = %.3f per write\n", label, node, s, n, s / n}' \
      "$OUT/$label.perf.$i"
  done | tee -a "$OUT/results.txt"
}

fsyncs() {
  start_single; fsyncs_of fsyncs-single 20000; stop_all
  start_cluster; fsyncs_of fsyncs-cluster 20000; stop_all
}

# ---- etcd, three members ------------------------------------------------------------------------

start_etcd() {
  local i cluster="" cports=() pports=()
  ETCD_ENDPOINTS=""; SERVERS=()
  for i in 1 2 3; do cports+=("$(free_port)"); pports+=("$(free_port)"); done
  for i in 1 2 3; do cluster+="${cluster:+,}m$i=http://127.0.0.1:${pports[$((i - 1))]}"; done
  for i in 1 2 3; do
    local dir; dir=$(mktemp -d); DIRS+=("$dir")
    etcd --name "m$i" --data-dir "$dir" \
      --listen-client-urls "http://127.0.0.1:${cports[$((i - 1))]}" \
      --advertise-client-urls "http://127.0.0.1:${cports[$((i - 1))]}" \
      --listen-peer-urls "http://127.0.0.1:${pports[$((i - 1))]}" \
      --initial-advertise-peer-urls "http://127.0.0.1:${pports[$((i - 1))]}" \
      --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token bench \
      --listen-metrics-urls "" >"$OUT/etcd-m$i.log" 2>&1 &
    SERVERS+=("$!"); PIDS+=("$!")
    ETCD_ENDPOINTS+="${ETCD_ENDPOINTS:+,}http://127.0.0.1:${cports[$((i - 1))]}"
  done
  local tries
  for tries in $(seq 300); do
    etcdctl --endpoints "$ETCD_ENDPOINTS" endpoint health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "etcd never became healthy" >&2; return 1
}

etcd_bench() {
  need_etcd
  start_etcd
  local before; before=$(cpu_sum "${SERVERS[@]}")
  /usr/bin/time -f '%U %S' -o "$OUT/etcd-put-c50.time" \
    "$ETCD_BENCH" --endpoints "$ETCD_ENDPOINTS" --clients 50 --conns 50 --val-size 64 \
    --key-space-size 10000 --duration "$DURATION" --warmup "$WARMUP" --json "$OUT/etcd-put-c50.json" \
    >"$OUT/etcd-put-c50.txt"
  local after; after=$(cpu_sum "${SERVERS[@]}")
  python3 - "$((after - before))" "$DURATION" "$WARMUP" "$(client_cpu_us "$OUT/etcd-put-c50.time")" "$OUT/etcd-put-c50.json" <<'EOF' | tee -a "$OUT/results.txt"
import json, sys
cpu_us, duration, warmup, client_us, r = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), json.load(open(sys.argv[5]))
total = r["ops_per_sec"] * (duration + warmup)
print(f"{'etcd3-put-c50':28} {r['ops_per_sec']:>10,.0f} ops/s  p50 {r['p50_us'] / 1000:6.2f} ms  p99 {r['p99_us'] / 1000:6.2f} ms  server cpu {cpu_us / total:6.1f} µs/op  client cpu {client_us / total:5.1f} µs/op  errors {r['errors']}")
EOF
  stop_all
}

echo "== $(date -u +%FT%TZ) $("$MQSTATE" --version 2>/dev/null || echo mqstate) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/results.txt"
case "$WHAT" in
  single) single ;;
  cluster) cluster ;;
  cluster-at-head) cluster_at_head ;;
  pubsub) pubsub ;;
  etcd) etcd_bench ;;
  fsyncs) fsyncs ;;
  all) single; cluster; etcd_bench; fsyncs ;;
  *) echo "unknown group: $WHAT (all|single|cluster|cluster-at-head|pubsub|etcd|fsyncs)" >&2; exit 2 ;;
esac
