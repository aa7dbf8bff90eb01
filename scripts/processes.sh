# Sourced by the benchmark scripts that start processes: each adds the PID of every process
# it starts to PIDS, and on exit, on failure too, those are stopped (by PID) and the
# temporary directory TMP is removed. Also what those scripts' loads share: a free loopback
# port, a Redis to decide on, and the rule they drive.
TMP="$(mktemp -d)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_redis PORT: a redis-server on 127.0.0.1:PORT that keeps nothing on disk (its log in
# TMP), stopped on exit like the rest; its PID in REDIS_PID. Returns once it answers.
start_redis() {
  redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no \
    --logfile "$TMP/redis.log" &
  REDIS_PID=$!
  PIDS+=("$REDIS_PID")
  for _ in $(seq 100); do redis-cli -p "$1" PING >/dev/null 2>&1 && break; sleep 0.05; done
}

# fixed_window_rules DIR: the rules file of the loads (domain bench, key fw): 10^9 a minute,
# a limit never reached.
fixed_window_rules() {
  mkdir -p "$1"
  cat >"$1/bench.yaml" <<'EOF'
domain: bench
descriptors:
  - key: fw
    rate_limit: {unit: minute, requests_per_unit: 1000000000}
EOF
}
