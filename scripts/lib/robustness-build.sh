# Shared by the robustness scripts (sourced): builds the driver (crates/robustness) and, unless
# MQSTATE_SERVER names the server binary to test (CI passes the static build), the server, with
# --release; sets `server` and `driver` to their paths.
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
if [ -n "${MQSTATE_SERVER:-}" ]; then
  cargo build --release --quiet -p mqstate-robustness
  server="$MQSTATE_SERVER"
else
  cargo build --release --quiet -p mqstate -p mqstate-robustness
  server="$TARGET/release/mqstate"
fi
driver="$TARGET/release/mqstate-robustness"
