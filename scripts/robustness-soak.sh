#!/usr/bin/env bash
# The long robustness figure (issue 18: 1,000 fault-injected runs, single node and 3-node
# cluster), in batches that can be stopped and resumed (docs/robustness.md).
#
#   scripts/robustness-soak.sh [--nodes 1|3] [--runs N] [--batch B] [--duration S] [--seed S]
#                              [--minutes M] [--dir DIR] [--parallel P]
#
# Runs the suite (scripts/robustness.sh, built once) in batches of B runs (default 10), batch k
# with seeds SEED + k*B ..; a batch whose report is complete is skipped, so running the same
# command again resumes where it stopped. Stops after N runs (default 1000) or once M minutes
# (default 60) have passed, whichever comes first (a batch is never cut short). Then sums every
# batch report in DIR (default target/robustness/soak-<nodes>) into DIR/summary.json and prints it:
# runs, operations, violations, acknowledged writes lost, faults, failpoints not reached, failing
# seeds. With --parallel P, P batches run at once (each driver its own processes, ports and, on 3
# nodes, network namespaces and subnet): about P times the runs per hour while the machine has the cores for it.
set -euo pipefail
cd "$(dirname "$0")/.."

nodes=1 runs=1000 batch=10 duration=15 seed=1000 minutes=60 dir="" parallel=1
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --minutes) minutes="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --parallel) parallel="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "robustness-soak: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
dir="${dir:-target/robustness/soak-$nodes}"
mkdir -p "$dir"

. scripts/lib/robustness-build.sh

# A batch is complete when its report counts all of its runs (the driver rewrites the report
# after every run, so a stopped batch leaves a partial one, which is run again).
complete() { [ -f "$1" ] && [ "$(jq -r '.runs' "$1" 2>/dev/null || echo 0)" = "$2" ]; }

case "$parallel" in
  ''|*[!0-9]*|0) echo "robustness-soak: --parallel takes a number of batches at once (1 or more)" >&2; exit 2 ;;
esac

# One batch with the driver; exit 1 (a failing check) is kept in its report, anything else is
# the suite failing to run.
run_batch() {
  local status=0
  "$driver" --server "$server" --nodes "$nodes" --runs "$2" --duration "$duration" \
    --seed "$1" --report "$3" >/dev/null || status=$?
  [ "$status" -le 1 ]
}

deadline=$(( $(date +%s) + minutes * 60 ))
done_runs=0
k=0
running=0
failed_to_run=0
while [ "$done_runs" -lt "$runs" ]; do
  n=$(( runs - done_runs < batch ? runs - done_runs : batch ))
  first=$(( seed + k * batch ))
  report="$dir/batch-$first.json"
  if ! complete "$report" "$n"; then
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "robustness-soak: the $minutes minutes are up after $done_runs runs; run the same command again to go on" >&2
      break
    fi
    if [ "$running" -ge "$parallel" ]; then
      wait -n || failed_to_run=1
      running=$(( running - 1 ))
    fi
    if [ "$failed_to_run" = 1 ]; then
      break
    fi
    echo "robustness-soak: batch $((k + 1)): seeds $first..$((first + n - 1))" >&2
    run_batch "$first" "$n" "$report" &
    running=$(( running + 1 ))
  fi
  done_runs=$(( done_runs + n ))
  k=$(( k + 1 ))
done
while [ "$running" -gt 0 ]; do
  wait -n || failed_to_run=1
  running=$(( running - 1 ))
done
if [ "$failed_to_run" = 1 ]; then
  echo "robustness-soak: the suite could not run (a driver exited with 2); see above" >&2
  exit 2
fi

# Sum every complete or partial batch report in the directory.
jq -s --argjson nodes "$nodes" --argjson duration "$duration" '{
    nodes: $nodes, duration_seconds: $duration,
    batches: length,
    runs: (map(.runs) | add // 0),
    operations: (map(.operations) | add // 0),
    unknown_operations: (map(.unknown_operations) | add // 0),
    notifications: (map(.notifications) | add // 0),
    violations: (map(.violations) | add // 0),
    acked_lost: (map(.acked_lost) | add // 0),
    incomplete_checks: (map(.incomplete_checks) | add // 0),
    faults: (map(.faults | to_entries) | add // [] | group_by(.key)
             | map({key: .[0].key, value: (map(.value) | add)}) | from_entries),
    failpoints_missed: (map(.failpoints_missed // {} | to_entries) | add // [] | group_by(.key)
             | map({key: .[0].key, value: (map(.value) | add)}) | from_entries),
    failing_seeds: (map(.failing_seeds) | add // [] | sort)
  }' "$dir"/batch-*.json > "$dir/summary.json"
cat "$dir/summary.json"
echo "$dir/summary.json"
[ "$(jq -r '.violations' "$dir/summary.json")" = "0" ]
