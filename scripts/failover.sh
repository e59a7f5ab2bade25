#!/usr/bin/env bash
# The state store's unavailability window after `kill -9` of a node (issue 15): three release-build
# nodes on loopback, `mqstate bench` against all three (`--servers`, reconnecting to the next node
# when its connection dies), one node killed mid-run; the bench's timeline gives the window, from
# the last successful reply before the kill to the first after it, reconnect included.
#
#   scripts/failover.sh [head|leader|both] [ROUNDS]     (default: both, 3 rounds each)
#
# head: kills a node that is not the Raft leader (it heads a third of the partitions); leader: kills
# the leader (it heads a third too). Env: SERVER (the server binary, default the release build; set
# it to a baseline to compare), DURATION (bench seconds, 14), KILL_AT (seconds into the run, 5),
# CLIENTS (12, one request in flight each), SERVE_FLAGS (extra flags for every node), OUT (reports,
# timelines, node logs; default target/failover), KEEP_DATA=1 (keep the nodes' data directories).
set -euo pipefail
cd "$(dirname "$0")/.."

WHAT="${1:-both}"
ROUNDS="${2:-3}"
OUT="${OUT:-target/failover}"
DURATION="${DURATION:-14}"
KILL_AT="${KILL_AT:-5}"
CLIENTS="${CLIENTS:-12}"
MQSTATE="${CARGO_TARGET_DIR:-$PWD/target}/release/mqstate"
SERVER="${SERVER:-$MQSTATE}"
read -r -a EXTRA <<<"${SERVE_FLAGS:-}"
mkdir -p "$OUT"
[ -n "${NO_BUILD:-}" ] || cargo build --release --quiet --bin mqstate

. scripts/lib/ports.sh
PIDS=()
stop_all() { local pid; for pid in "${PIDS[@]:-}"; do if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then wait "$pid" 2>/dev/null || true; fi; done; PIDS=(); }
trap stop_all EXIT

# status PORT: the cluster status JSON as node at PORT sees it (empty if it does not answer).
status() { "$MQSTATE" cluster status --port "$1" --json --timeout 2 2>/dev/null || true; }

# formed PORT...: every node names the same leader, every member up, no partition pending, every
# read view the whole chain.
formed() {
  local first="" port s l
  for port in "$@"; do
    s=$(status "$port")
    [ -n "$s" ] || return 1
    l=$(python3 -c '
import json, sys
s = json.loads(sys.argv[1])
ok = s["leader"] and s["partitions"] and all(m["state"] == "up" for m in s["members"]) \
    and all(not p["pending"] and p["read_view"] == p["chain"] and len(p["chain"]) == 3 for p in s["partitions"])
print(s["leader"] if ok else "none")' "$s")
    [ "$l" != none ] || return 1
    [ -z "$first" ] || [ "$l" = "$first" ] || return 1
    first=$l
  done
}

round() { # case (head|leader), round number
  local case="$1" n="$2" i
  local ports=() cports=() peers=""
  for i in 1 2 3; do ports+=("$(free_port)"); cports+=("$(free_port)"); done
  for i in 1 2 3; do peers+="${peers:+,}$i=127.0.0.1:${cports[$((i - 1))]}"; done
  PIDS=()
  for i in 1 2 3; do
    local data="$OUT/$case-$n.node$i.data"
    rm -rf "$data"
    "$SERVER" serve --listen "127.0.0.1:${ports[$((i - 1))]}" --data-dir "$data" --node-id "$i" \
      --cluster-listen "127.0.0.1:${cports[$((i - 1))]}" --peers "$peers" "${EXTRA[@]}" \
      >"$OUT/$case-$n.node$i.log" 2>&1 &
    PIDS+=("$!")
  done
  for i in 1 2 3; do wait_port "${ports[$((i - 1))]}"; done
  local tries=0
  until formed "${ports[@]}"; do
    tries=$((tries + 1)); [ "$tries" -lt 300 ] || { echo "cluster never formed" >&2; return 1; }
    sleep 0.2
  done
  local leader victim
  leader=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["leader"])' "$(status "${ports[0]}")")
  if [ "$case" = leader ]; then victim=$leader; else victim=$(( leader % 3 + 1 )); fi
  local servers="" p
  for p in "${ports[@]}"; do servers+="${servers:+,}127.0.0.1:$p"; done
  "$MQSTATE" bench --servers "$servers" --connections "$CLIENTS" --inflight 1 --mix set=50,get=50 \
    --keys 10000 --duration "$DURATION" --timeout 10 --timeline "$OUT/$case-$n.timeline.json" \
    >"$OUT/$case-$n.bench.txt" 2>&1 &
  local bench=$!
  sleep "$KILL_AT"
  kill -9 "${PIDS[$((victim - 1))]}"; wait "${PIDS[$((victim - 1))]}" 2>/dev/null || true
  echo "$(date -u +%T) round $n: killed node $victim ($case; leader was $leader)" >>"$OUT/$case-$n.bench.txt"
  wait "$bench" || true
  stop_all
  # The data directories are kept (KEEP_DATA=1) for `mqstate data inspect`.
  [ -n "${KEEP_DATA:-}" ] || rm -rf "$OUT/$case-$n".node?.data
  python3 -c '
import json, sys
u = json.load(open(sys.argv[1]))["unavailability"]
c, o = u.get("one_client") or {}, u.get("overall") or {}
cl, cf, ol = c.get("length_s", 0), c.get("from_s", 0), o.get("length_s", 0)
print(f"{sys.argv[2]:6} round {sys.argv[3]}: window {cl:.3f} s on one client (from {cf:.1f} s), {ol:.3f} s overall")
' "$OUT/$case-$n.timeline.json" "$case" "$n"
}

cases=()
case "$WHAT" in
  head) cases=(head) ;;
  leader) cases=(leader) ;;
  both) cases=(head leader) ;;
  *) echo "usage: $0 [head|leader|both] [ROUNDS]" >&2; exit 2 ;;
esac
for c in "${cases[@]}"; do
  for n in $(seq "$ROUNDS"); do round "$c" "$n"; done
done
