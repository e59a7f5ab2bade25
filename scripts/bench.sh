#!/usr/bin/env bash
# Reproduces every figure in docs/benchmarks.md: mqstate side by side with Mosquitto (+ the
# `mqstate bench --responder` baseline) and with Redis, on this machine, in one run.
#
#   scripts/bench.sh [all|pubsub|statestore|redis|idle|restart|snapshot-rss|notify]   (default: all)
#
# Needs: mosquitto (Debian 2.0.11), redis-server + redis-benchmark (Debian, Redis 7), a release build
# (built here). Results (JSON per run, server logs) go to $OUT (default target/bench-results/).
# Each server runs alone on its own free port and is stopped before the next one starts.
set -euo pipefail
cd "$(dirname "$0")/.."

WHAT="${1:-all}"
OUT="${OUT:-target/bench-results}"
DURATION="${DURATION:-10}"
WARMUP="${WARMUP:-2}"
MQSTATE="${CARGO_TARGET_DIR:-$PWD/target}/release/mqstate"
mkdir -p "$OUT"
cargo build --release --quiet

. scripts/lib/ports.sh
PIDS=()
stop_all() { local pid; for pid in "${PIDS[@]:-}"; do if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then wait "$pid" 2>/dev/null || true; fi; done; PIDS=(); }
trap stop_all EXIT

start_mqstate() { # name, extra serve flags...
  local name="$1"; shift
  PORT=$(free_port); DATA=$(mktemp -d)
  "$MQSTATE" serve --listen "127.0.0.1:$PORT" --data-dir "$DATA" "$@" >"$OUT/$name.server.log" 2>&1 &
  SERVER_PID=$!; PIDS+=("$SERVER_PID"); wait_port "$PORT"
}
start_mosquitto() { # name
  PORT=$(free_port); local conf="$OUT/mosquitto.conf"
  # Mosquitto at its best for this test: Nagle off (its default is on, which adds ~40 ms delayed-ACK
  # stalls to request/response) and the same in-flight window and queue bound as mqstate's defaults.
  printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nset_tcp_nodelay true\nmax_inflight_messages 256\nmax_queued_messages 1000\n' "$PORT" >"$conf"
  mosquitto -c "$conf" >"$OUT/$1.server.log" 2>&1 &
  SERVER_PID=$!; PIDS+=("$SERVER_PID"); wait_port "$PORT"
}
start_responder() {
  "$MQSTATE" bench --responder --port "$PORT" --connections 8 >"$OUT/responder.log" 2>&1 &
  PIDS+=("$!"); sleep 1
}
bench() { # name, bench flags...
  local name="$1"; shift
  echo "== $name"
  "$MQSTATE" bench --port "$PORT" --duration "$DURATION" --warmup "$WARMUP" --json "$OUT/$name.json" "$@" | tail -n 12
}

statestore() {
  for shape in "1 1" "16 8" "64 16"; do
    set -- $shape; local c=$1 i=$2
    local common=(--connections "$c" --inflight "$i" --mix set=50,get=50 --keys 10000 --value-size 64)
    start_mosquitto "mosquitto-responder-${c}x${i}"; start_responder
    bench "ss-mosquitto-responder-${c}x${i}" "${common[@]}"; stop_all
    start_mqstate "ss-mqstate-nolog-${c}x${i}" --persistence opt-in
    bench "ss-mqstate-nolog-${c}x${i}" "${common[@]}"; stop_all
    start_mqstate "ss-mqstate-fsync-${c}x${i}" --fsync always
    bench "ss-mqstate-fsync-${c}x${i}" "${common[@]}"; stop_all
  done
}

pubsub() {
  # 16 -> 16 with a publish window of 1 (each publisher waits for its PUBACK), 1 -> 100 with 16.
  for shape in "16 16 1" "1 100 16"; do
    set -- $shape; local p=$1 s=$2 w=$3
    local common=(--mode pubsub --publishers "$p" --subscribers "$s" --qos 1 --payload 64 --inflight "$w")
    start_mosquitto "mosquitto-pubsub-${p}x${s}"; bench "pubsub-mosquitto-${p}x${s}" "${common[@]}"; stop_all
    start_mqstate "mqstate-pubsub-${p}x${s}"; bench "pubsub-mqstate-${p}x${s}" "${common[@]}"; stop_all
  done
}

# CPU time (user + system) of a process so far, in microseconds.
cpu_us() { awk -v tck="$(getconf CLK_TCK)" '{printf "%d", ($14 + $15) * 1000000 / tck}' "/proc/$1/stat"; }
# "server X µs + load generator Y µs" per request, from CPU µs used and the request count.
per_request() { awk -v s="$1" -v c="$2" -v n="$3" 'BEGIN {printf "cpu per request: server %.1f µs + load generator %.1f µs\n", s / n, c / n}'; }

redis() {
  local n=400000
  PORT=$(free_port); local dir; dir=$(mktemp -d)
  redis-server --port "$PORT" --bind 127.0.0.1 --dir "$dir" --appendonly yes --appendfsync always \
    --save '' >"$OUT/redis.server.log" 2>&1 &
  local redis_pid=$!; PIDS+=("$redis_pid"); wait_port "$PORT"
  echo "== redis appendfsync always: redis-benchmark -t set -c 50"
  local before; before=$(cpu_us "$redis_pid")
  local TIMEFORMAT="%U %S"; local client
  client=$( { time redis-benchmark -p "$PORT" -t set -c 50 -n "$n" -d 64 -r 10000 --csv \
    >"$OUT/redis-set-c50.csv"; } 2>&1 )
  local server=$(( $(cpu_us "$redis_pid") - before ))
  tail -n 1 "$OUT/redis-set-c50.csv"
  per_request "$server" "$(echo "$client" | awk '{printf "%d", ($1 + $2) * 1000000}')" "$n" | tee "$OUT/redis-set-c50.cpu"
  stop_all
  start_mqstate "durable-set-c50" --fsync always
  # No warm-up here: CPU is divided by the requests counted, so every request must be counted.
  local WARMUP=0
  before=$(cpu_us "$SERVER_PID")
  client=$( { time bench "durable-set-mqstate-c50" --connections 50 --inflight 1 --mix set=100 \
    --keys 10000 --value-size 64 >"$OUT/durable-set-mqstate-c50.txt"; } 2>&1 )
  server=$(( $(cpu_us "$SERVER_PID") - before ))
  cat "$OUT/durable-set-mqstate-c50.txt"
  local ops; ops=$(awk '$1 == "ops" {print $2}' "$OUT/durable-set-mqstate-c50.txt")
  per_request "$server" "$(echo "$client" | awk '{printf "%d", ($1 + $2) * 1000000}')" "$ops" | tee "$OUT/durable-set-mqstate-c50.cpu"
  stop_all
}

idle() {
  # Each connection is a descriptor in the server and one in the load generator: the file limit is
  # raised for the benchmark's processes only (in a subshell), not in the product's defaults. Where
  # the hard limit is lower (containers), the larger run takes as many connections as it allows.
  local n
  for n in ${IDLE_CONNECTIONS:-10000 100000}; do
    (
      if ! ulimit -n $((n + 1024)) 2>/dev/null; then
        hard=$(ulimit -Hn)
        echo "== $n idle connections: file limit $hard < $((n + 1024)); measuring $((hard - 1024)) instead"
        n=$((hard - 1024))
        ulimit -n "$hard"
      fi
      trap stop_all EXIT
      start_mqstate "idle-$n" --max-connections $((n + 100))
      echo "== $n idle connections"
      "$MQSTATE" bench --mode idle --port "$PORT" --connections "$n" --duration 5 \
        --server-pid "$SERVER_PID" --json "$OUT/idle-$n.json"
      stop_all
    )
  done
}

restart() {
  start_mqstate "restart-1m" --fsync never
  echo "== load 1,000,000 keys of 100 bytes"
  "$MQSTATE" bench --port "$PORT" --connections 16 --inflight 64 --mix set=100 --keys 1000000 \
    --distribution sequential --value-size 100 --requests 1000000 --json "$OUT/restart-load.json" | tail -n 4
  echo "server memory with 1,000,000 keys: $(grep VmRSS "/proc/$SERVER_PID/status")"
  echo "raw bytes of keys + values: $((1000000 * (16 + 100) / 1024)) kB"
  kill -TERM "$SERVER_PID"; wait "$SERVER_PID" || true; PIDS=()
  echo "== restart"
  local t0; t0=$(date +%s.%N)
  "$MQSTATE" serve --listen "127.0.0.1:$PORT" --data-dir "$DATA" >"$OUT/restart-1m.restart.log" 2>&1 &
  SERVER_PID=$!; PIDS+=("$SERVER_PID"); wait_port "$PORT"
  echo "ready after $(echo "$(date +%s.%N) - $t0" | bc) s"
  grep 'state recovered' "$OUT/restart-1m.restart.log" || true
  echo "server memory after the restart: $(grep VmRSS "/proc/$SERVER_PID/status")"
  stop_all
}

# Peak RSS while a snapshot of 1,000,000 keys (100-byte values) is written. The threshold is above
# what loading the keys logs (about 253 bytes a SET with its request identity), so the first load takes
# no snapshot and its peak is the "before"; a second pass over the same keys crosses it once, so a
# snapshot of all 1,000,000 keys is taken while the same load goes on: the peak after it is "during".
snapshot_rss() {
  local load=(--connections 16 --inflight 64 --mix set=100 --keys 1000000 --distribution sequential
    --value-size 100 --requests 1000000)
  start_mqstate "snapshot-rss" --fsync never --snapshot-threshold-bytes 300000000
  local raw=$((1000000 * (16 + 100) / 1024))
  "$MQSTATE" bench --port "$PORT" "${load[@]}" --json "$OUT/snapshot-rss-load-1.json" | tail -n 2
  local before; before=$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status")
  "$MQSTATE" bench --port "$PORT" "${load[@]}" --json "$OUT/snapshot-rss-load-2.json" | tail -n 2
  for _ in $(seq 600); do grep -q 'snapshot written' "$OUT/snapshot-rss.server.log" && break; sleep 0.1; done
  local during; during=$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status")
  echo "raw keys + values: $raw kB; VmHWM before the snapshot: $before kB ($(echo "scale=2; $before / $raw" | bc)x);" \
    "after the pass with the snapshot: $during kB ($(echo "scale=2; $during / $raw" | bc)x)"
  grep -c 'snapshot written' "$OUT/snapshot-rss.server.log" | sed 's/^/snapshots written: /'
  stop_all
}

# Persistent notifications (docs/benchmarks.md). The durable SET rate with no topic and with one
# topic matching every key (its HTTP endpoint up and delivering while the load runs), NOTIFY_RUNS
# pairs (default 3) interleaved (alternating which goes first) so that both see the same background
# load, then the median and spread
# of each and of their ratio; then notifications delivered per second to a local HTTP endpoint
# (100,000 queued while it is down, drained once it is up), NOTIFY_RUNS times.
notify() {
  local runs="${NOTIFY_RUNS:-3}" run none one
  local rates="$OUT/notify-set.rates"; : >"$rates"
  for run in $(seq "$runs"); do
    # Which goes first alternates, so that neither always follows the other.
    if [ $((run % 2)) = 1 ]; then
      none=$(notify_set_rate "$run" none); one=$(notify_set_rate "$run" one)
    else
      one=$(notify_set_rate "$run" one); none=$(notify_set_rate "$run" none)
    fi
    echo "$run $none $one" >>"$rates"
  done
  notify_set_summary "$rates"
  local drains="$OUT/notify-drain.rates"; : >"$drains"
  for run in $(seq "$runs"); do notify_drain_rate "$run" | tee -a "$drains"; done
  echo "notifications delivered per second: median $(median <"$drains"), min $(sort -n "$drains" | head -n 1), max $(sort -n "$drains" | tail -n 1)"
}

median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
json_field() { python3 -c 'import json, sys; print(round(json.load(open(sys.argv[1]))[sys.argv[2]]))' "$1" "$2"; }

# Prints the durable SET rate of one run (ops/s) with `none` or `one` topic, then the server's CPU
# time per SET (µs; on a shared machine steadier than the rate) and the HTTP sink's; the rest goes to
# $OUT. No warm-up: CPU is divided by the requests counted, so every request must be counted.
notify_set_rate() { # run, none|one
  local name="notify-set-$2-$1" sink_port sink_pid="" WARMUP=0
  if [ "$2" = one ]; then
    sink_port=$(free_port)
    python3 scripts/notify-sink.py "$sink_port" "$OUT/$name.count" & sink_pid=$!; PIDS+=("$sink_pid")
    wait_port "$sink_port"
  fi
  start_mqstate "$name" --fsync always
  if [ "$2" = one ]; then
    "$MQSTATE" topic create bench --port "$PORT" --endpoint "http://127.0.0.1:$sink_port/hook" \
      --keys 'bench:*' --max-queue 10000000 --json >/dev/null
  fi
  local server_before sink_before=0 sink_after=0
  server_before=$(cpu_us "$SERVER_PID")
  [ -n "$sink_pid" ] && sink_before=$(cpu_us "$sink_pid")
  bench "$name" --connections 50 --inflight 1 --mix set=100 --keys 10000 --value-size 64 \
    >"$OUT/$name.txt"
  local server=$(( $(cpu_us "$SERVER_PID") - server_before ))
  if [ -n "$sink_pid" ]; then
    "$MQSTATE" topic stats bench --port "$PORT" --json >"$OUT/$name.stats.json"
    sink_after=$(cpu_us "$sink_pid")
  fi
  stop_all
  local ops; ops=$(awk '$1 == "ops" {print $2}' "$OUT/$name.txt")
  echo "$(json_field "$OUT/$name.json" ops_per_sec) $(echo "scale=1; $server / $ops" | bc) $(echo "scale=1; ($sink_after - $sink_before) / $ops" | bc)"
}

stat_line() { # label, column, file
  local values; values=$(awk -v c="$2" '{print $c}' "$3")
  echo "$1: median $(echo "$values" | median), min $(echo "$values" | sort -n | head -n 1), max $(echo "$values" | sort -n | tail -n 1)"
}

notify_set_summary() { # file of "run none-rate none-cpu none-sink one-rate one-cpu one-sink" lines
  echo "== durable SET/s, 50 x 1, fsync always: no topic vs one matching topic (endpoint up)"
  awk '{printf "run %d: %d vs %d SET/s (%+.1f %%); server CPU per SET %.1f vs %.1f µs (+ sink %.1f µs)\n", $1, $2, $5, ($5 / $2 - 1) * 100, $3, $6, $7}' "$1"
  stat_line "no topic SET/s" 2 "$1"
  stat_line "one topic SET/s" 5 "$1"
  stat_line "no topic, server CPU µs per SET" 3 "$1"
  stat_line "one topic, server CPU µs per SET" 6 "$1"
  stat_line "one topic, HTTP sink CPU µs per SET" 7 "$1"
  local ratios; ratios=$(awk '{printf "%.1f\n", ($5 / $2 - 1) * 100}' "$1")
  echo "SET/s change per pair: median $(echo "$ratios" | median) %, from $(echo "$ratios" | sort -n | head -n 1) % to $(echo "$ratios" | sort -n | tail -n 1) % (target: no lower than -20 %)"
}

# Prints notifications delivered per second: 100,000 queued while the endpoint is down, then the time
# until the queue is empty once it is up.
notify_drain_rate() { # run
  local name="notify-drain-$1" sink_port; sink_port=$(free_port)
  # The sink listens from the start (no other connection can take its port) but answers 503 until
  # the gate file exists: the endpoint is down while the queue fills.
  local gate="$OUT/$name.up"; rm -f "$gate"
  python3 scripts/notify-sink.py "$sink_port" "$OUT/$name.count" "$gate" & PIDS+=("$!")
  wait_port "$sink_port"
  start_mqstate "$name" --fsync always --notify-retry-min-ms 100 --notify-retry-max-ms 100
  "$MQSTATE" topic create drain --port "$PORT" --endpoint "http://127.0.0.1:$sink_port/hook" \
    --keys 'bench:*' --max-queue 200000 --json >/dev/null
  "$MQSTATE" bench --port "$PORT" --connections 16 --inflight 16 --mix set=100 --keys 100000 \
    --distribution sequential --value-size 64 --requests 100000 >"$OUT/$name.load.txt"
  local t0; t0=$(date +%s.%N)
  touch "$gate"
  local left=1
  while [ "$left" != 0 ]; do
    sleep 0.1
    left=$("$MQSTATE" topic stats drain --port "$PORT" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["entries"])') || left=1
  done
  local took; took=$(echo "$(date +%s.%N) - $t0" | bc)
  stop_all
  echo "100000 / $took" | bc
}

case "$WHAT" in
  all) statestore; pubsub; redis; idle; restart; snapshot_rss; notify ;;
  statestore|pubsub|redis|idle|restart|notify) "$WHAT" ;;
  snapshot-rss) snapshot_rss ;;
  *) echo "usage: $0 [all|pubsub|statestore|redis|idle|restart|snapshot-rss|notify]" >&2; exit 2 ;;
esac
