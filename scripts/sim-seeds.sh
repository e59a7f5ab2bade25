#!/usr/bin/env bash
# Runs many seeds of a deterministic simulation in JOBS processes at once: SIM=data (the default)
# is the data plane's (crates/replication/tests/turmoil_sim.rs, decision 0058), SIM=front a node's
# MQTT front end (crates/statestore/tests/turmoil_sim.rs, decision 0067), SIM=cluster three cluster
# members with their front ends (crates/node/tests/turmoil_sim.rs, decision 0071).
#
#   scripts/sim-seeds.sh COUNT [FIRST]            (FIRST defaults to 1)
#   REPLAY=1 scripts/sim-seeds.sh COUNT [FIRST]   (each seed twice; the two histories must be equal
#                                                  byte for byte: the simulation is deterministic)
#
# JOBS (default: the number of cores) processes each take a slice of the seeds;
# MQSTATE_DATA_SIM_CHAOS_SECS (MQSTATE_FRONT_SIM_* for SIM=front, MQSTATE_CLUSTER_FRONT_SIM_* for
# SIM=cluster) and the other variables of the
# simulation pass through. The
# histories go to $OUT (default target/sim-seeds), one file per seed and run; a failing slice's
# output is kept in $OUT/slice-*.log. Exits non-zero if a seed fails its checks or replays
# differently.
set -euo pipefail
cd "$(dirname "$0")/.."

COUNT="${1:?usage: $0 COUNT [FIRST]}"
FIRST="${2:-1}"
JOBS="${JOBS:-$(nproc)}"
REPLAY="${REPLAY:-}"
SIM="${SIM:-data}"
case "$SIM" in
  data)
    SOURCE=crates/replication/tests/turmoil_sim.rs VARS=MQSTATE_DATA_SIM
    TEST=the_data_plane_is_linearizable_and_loses_no_acknowledged_write_under_faults ;;
  front)
    SOURCE=crates/statestore/tests/turmoil_sim.rs VARS=MQSTATE_FRONT_SIM
    TEST=a_node_front_end_is_linearizable_and_loses_no_acknowledged_write_under_faults ;;
  cluster)
    SOURCE=crates/node/tests/turmoil_sim.rs VARS=MQSTATE_CLUSTER_FRONT_SIM
    TEST=the_cluster_is_linearizable_and_loses_no_acknowledged_write_under_faults ;;
  *) echo "SIM is data, front or cluster, not $SIM" >&2; exit 2 ;;
esac
OUT="${OUT:-${CARGO_TARGET_DIR:-target}/sim-seeds-$SIM}"

# Built with --workspace, the features the test run already built with, so nothing is built again;
# several packages have a `turmoil_sim` test, the one wanted is picked by its source path. Cargo's
# messages are kept and shown if the build fails.
mkdir -p "${CARGO_TARGET_DIR:-target}"
BUILD_LOG="${CARGO_TARGET_DIR:-target}/sim-seeds-build.log"
if ! cargo test --workspace --test turmoil_sim --no-run --message-format=json >"$BUILD_LOG.json" 2>"$BUILD_LOG"; then
  echo "could not build the simulation test (cargo exited non-zero); its messages:" >&2
  tail -40 "$BUILD_LOG" >&2
  exit 2
fi
BIN="$(grep "$SOURCE" "$BUILD_LOG.json" |
  sed -n 's/.*"executable":"\([^"]*turmoil_sim[^"]*\)".*/\1/p' | tail -1)"
[ -x "$BIN" ] || { echo "could not find the simulation test's executable in $BUILD_LOG.json" >&2; exit 2; }

rm -rf "$OUT"
mkdir -p "$OUT"
runs=(a)
[ -n "$REPLAY" ] && runs=(a b)

per=$(( (COUNT + JOBS - 1) / JOBS ))
started=$(date +%s)
pids=()
for run in "${runs[@]}"; do
  for ((j = 0; j < JOBS; j++)); do
    first=$(( FIRST + j * per ))
    count=$(( FIRST + COUNT - first ))
    (( count > per )) && count=$per
    (( count <= 0 )) && continue
    env "${VARS}_FIRST=$first" "${VARS}_SEEDS=$count" "${VARS}_DUMP=$OUT/history-$run" \
      "$BIN" --exact "$TEST" --nocapture >"$OUT/slice-$run-$first.log" 2>&1 &
    pids+=($!)
  done
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
elapsed=$(( $(date +%s) - started ))

grep -h "turmoil sweep" "$OUT"/slice-a-*.log | sed 's/^/  /'
grep -h "became readable only" "$OUT"/slice-a-*.log | sed 's/^/  /' || true
if (( failed )); then
  grep -l "FAILED\|panicked" "$OUT"/slice-*.log | sed 's/^/  failing slice: /'
fi

differ=()
if [ -n "$REPLAY" ]; then
  for ((s = FIRST; s < FIRST + COUNT; s++)); do
    cmp -s "$OUT/history-a.$s" "$OUT/history-b.$s" || differ+=("$s")
  done
  echo "replayed: $(( COUNT - ${#differ[@]} )) of $COUNT seeds gave the same history twice${differ[*]:+; differ: ${differ[*]}}"
fi
echo "$COUNT seeds from $FIRST in ${elapsed} s with $JOBS jobs${REPLAY:+ (each twice)}"
(( failed == 0 && ${#differ[@]} == 0 ))
