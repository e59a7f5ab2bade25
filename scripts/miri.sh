#!/usr/bin/env bash
# Runs the store crate's unsafe module (`crates/store/src/keyspace/thin.rs`) and the keyspace tests
# that drive it under Miri, which checks every pointer access against Rust's memory model.
# The property test that compares the keyspace with a BTreeMap model is skipped here: under Miri it
# takes longer than CI can give; it runs natively in `cargo test` and cleanly under valgrind
# (decision 0015).
# Needs a nightly toolchain with the miri and rust-src components; installs them with rustup when
# it can, and says so plainly when it cannot.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "miri: installing the nightly toolchain with miri and rust-src"
  if ! rustup toolchain install nightly --profile minimal --component miri --component rust-src; then
    echo "miri: SKIPPED — no nightly toolchain with miri could be installed on this machine" >&2
    exit 0
  fi
fi

# Isolation off: the test harness reads the working directory. Own target dir: Miri's artefacts are
# built differently and would evict the normal build's.
MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}" CARGO_TARGET_DIR="${MIRI_TARGET_DIR:-target/miri}" \
  cargo +nightly miri test -p mqstate-store --lib keyspace:: -- --skip behaves_like_a_btreemap
