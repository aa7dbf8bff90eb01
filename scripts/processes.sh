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

# free_port: a loopback port nothing holds, below the kernel's range of ephemeral ports. One
# the kernel hands out (bind to port 0) can go to a load's outgoing connection before the
# server meant to listen on it binds it: a full run once lost its last part that way.
free_port() {
  python3 - <<'EOF'
import random, socket
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral = int(ranges.read().split()[0])
except OSError:
    ephemeral = 32768
for _ in range(1000):
    port = random.randrange(10000, ephemeral)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
    break
else:
    raise SystemExit("no free loopback port below the ephemeral range")
EOF
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
