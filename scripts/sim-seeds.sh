#!/usr/bin/env bash
# Runs many seeds of the data-plane simulation (crates/replication/tests/turmoil_sim.rs,
# decision 0058) in JOBS processes at once:
#
#   scripts/sim-seeds.sh COUNT [FIRST]            (FIRST defaults to 1)
#   REPLAY=1 scripts/sim-seeds.sh COUNT [FIRST]   (each seed twice; the two histories must be equal
#                                                  byte for byte: the simulation is deterministic)
#
# JOBS (default: the number of cores) processes each take a slice of the seeds;
# MQSTATE_DATA_SIM_CHAOS_SECS and the other MQSTATE_DATA_SIM_* variables pass through. The
# histories go to $OUT (default target/sim-seeds), one file per seed and run; a failing slice's
# output is kept in $OUT/slice-*.log. Exits non-zero if a seed fails its checks or replays
# differently.
set -euo pipefail
cd "$(dirname "$0")/.."

COUNT="${1:?usage: $0 COUNT [FIRST]}"
FIRST="${2:-1}"
JOBS="${JOBS:-$(nproc)}"
OUT="${OUT:-${CARGO_TARGET_DIR:-target}/sim-seeds}"
REPLAY="${REPLAY:-}"

# Built with --workspace, the features the test run already built with, so nothing is built again;
# two packages have a `turmoil_sim` test, the data plane's is picked by its source path. Cargo's
# messages are kept and shown if the build fails.
mkdir -p "${CARGO_TARGET_DIR:-target}"
BUILD_LOG="${CARGO_TARGET_DIR:-target}/sim-seeds-build.log"
if ! cargo test --workspace --test turmoil_sim --no-run --message-format=json >"$BUILD_LOG.json" 2>"$BUILD_LOG"; then
  echo "could not build the simulation test (cargo exited non-zero); its messages:" >&2
  tail -40 "$BUILD_LOG" >&2
  exit 2
fi
BIN="$(grep 'crates/replication/tests/turmoil_sim.rs' "$BUILD_LOG.json" |
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
    MQSTATE_DATA_SIM_FIRST=$first MQSTATE_DATA_SIM_SEEDS=$count \
      MQSTATE_DATA_SIM_DUMP="$OUT/history-$run" \
      "$BIN" --exact the_data_plane_is_linearizable_and_loses_no_acknowledged_write_under_faults \
      --nocapture >"$OUT/slice-$run-$first.log" 2>&1 &
    pids+=($!)
  done
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
elapsed=$(( $(date +%s) - started ))

grep -h "data-plane turmoil sweep" "$OUT"/slice-a-*.log | sed 's/^/  /'
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
