#!/bin/sh
# Builds the static (musl) `mqstate` the container image ships, for this machine's architecture, into
# DIR (default ./out). Needs rustup and musl-gcc (Debian: musl-tools) for the C parts of ring and
# jemalloc; no OpenSSL (the binary's TLS is rustls). packaging/Dockerfile and CI run this same script.
set -eu
out="${1:-out}"
target="$(uname -m)-unknown-linux-musl"
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
  cargo build --release --locked --target "$target" --bin mqstate
install -D "${CARGO_TARGET_DIR:-target}/$target/release/mqstate" "$out/mqstate"
echo "built $out/mqstate ($target)"
