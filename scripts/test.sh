#!/usr/bin/env bash
# Runs every test (unit, property and integration tests against the real server on loopback) on a
# machine with nothing but Rust installed: first installs what building and testing need, then runs
# `cargo test --workspace` (extra arguments are passed on to it). CI (`.ci/run`) runs this same script;
# `scripts/test.sh --deps-only` installs and stops (CI does that before clippy, which builds the tests).
#
# What it installs (Debian/Ubuntu, with apt-get as root or through sudo):
#   gcc, make          C parts of ring (TLS) and jemalloc (the allocator, decision 0015)
#   pkg-config,        OpenSSL for the official AIO SDK, which the tests use to prove compatibility
#   libssl-dev         (the mqstate binary itself links no OpenSSL)
#   mosquitto          side-by-side tests against Mosquitto
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
command -v make >/dev/null 2>&1 || need_apt+=(make)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
if ! pkg-config --exists openssl 2>/dev/null; then need_apt+=(libssl-dev); fi
command -v mosquitto >/dev/null 2>&1 || need_apt+=(mosquitto mosquitto-clients)

if [ "${#need_apt[@]}" -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: missing ${need_apt[*]} and no apt-get to install them: install the equivalents" \
         "(a C compiler, make, pkg-config, OpenSSL headers, mosquitto) and run again" >&2
    exit 2
  fi
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "test.sh: installing ${need_apt[*]} needs root or sudo" >&2; exit 2; }
    sudo=(sudo)
  fi
  echo "test.sh: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ "${1:-}" = "--deps-only" ]; then
  exit 0
fi
exec cargo test --workspace "$@"
