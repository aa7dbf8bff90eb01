# Sourced by the benchmark scripts that start processes: each adds the PID of every process
# it starts to PIDS, and on exit, on failure too, those are stopped (by PID) and the
# temporary directory TMP is removed.
TMP="$(mktemp -d)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
