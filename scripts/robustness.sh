#!/usr/bin/env bash
# The robustness suite (docs/robustness.md): real `mqstate serve` processes under injected faults
# (kill -9, SIGSTOP pauses, a full disk, crashes at failpoints, power loss, client clock skew; with
# --nodes 3 also crashes at the chain protocol's failpoints, per-node clock offsets, and partitions,
# packet loss and slow links between nodes, each in its own namespace), many concurrent
# state-store clients, a persistent notification queue, and checks of the history.
#
#   scripts/robustness.sh [--nodes 1|3] [--runs N] [--duration S] [--seed S] [--report FILE]
#                         [--check-budget S] [--fsync POLICY] [--faults KIND,…] [--keep]
#                         [--no-cluster-observers]
# (`--faults`' kinds: `mqstate-robustness --help`.)
#
# Builds the server and the driver (crates/robustness) with --release, then runs the driver; with
# MQSTATE_SERVER=PATH it tests that server binary instead (CI passes the static build). The JSON
# report's path is the last line on stdout; the exit status is 1 when a check failed. Failing runs
# keep their data directory, server log, history.json and timeline.html under <report dir>/runs/<seed>/.
set -euo pipefail
cd "$(dirname "$0")/.."

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  esac
done
# A cluster run puts each node in a network namespace (iproute2's `ip`, `tc`) and drops packets
# with nftables; a fresh Debian machine lacks nftables, and a fault that cannot start is reported as
# a failed run, so install what is missing when we can.
if [[ " $* " == *" --nodes 3 "* ]]; then
  need=()
  command -v nft >/dev/null 2>&1 || need+=(nftables)
  { command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; } || need+=(iproute2)
  if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "robustness.sh: installing ${need[*]}" >&2
      DEBIAN_FRONTEND=noninteractive apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
      echo "robustness.sh: --nodes 3 needs ${need[*]} (and root); install them and run again" >&2
      exit 2
    fi
  fi
fi
. scripts/lib/robustness-build.sh
exec "$driver" --server "$server" "$@"
