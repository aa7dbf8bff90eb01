#!/usr/bin/env bash
# One hot key on a 3-master Redis Cluster, with and without `shards`: the throughput a
# single limit reaches when it lives in one slot (one node), and when it is split over 8.
#
#   scripts/bench_shards.sh [seconds per run, default 10]
#
# Starts its own 3 redis-server processes (free loopback ports, no persistence), makes them a
# Cluster with redis-cli, runs one turnstile per configuration and `turnstile-bench` against
# it, prints one line per run, and stops every process it started (by PID), on failure too.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_RUN="${1:-10}"

cargo build --release --quiet --workspace
BIN=target/release/turnstile
LOADGEN=target/release/turnstile-bench
# shellcheck source=scripts/processes.sh
. scripts/processes.sh

free_port() { # a port with its Cluster bus port (+10000) free too
  python3 - <<'PY'
import random, socket
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); return True
    except OSError:
        return False
    finally:
        s.close()
while True:
    p = random.randint(20000, 45000)
    if free(p) and free(p + 10000):
        print(p); break
PY
}

NODES=()
for i in 1 2 3; do
  port="$(free_port)"
  mkdir -p "$TMP/n$i"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --cluster-enabled yes --cluster-config-file "$TMP/n$i/nodes.conf" --dir "$TMP/n$i" \
    --logfile "$TMP/n$i/log" &
  PIDS+=("$!")
  NODES+=("127.0.0.1:$port")
done
for node in "${NODES[@]}"; do
  for _ in $(seq 100); do redis-cli -u "redis://$node" ping >/dev/null 2>&1 && break; sleep 0.05; done
done
redis-cli --cluster create "${NODES[@]}" --cluster-yes >/dev/null
for _ in $(seq 200); do
  redis-cli -u "redis://${NODES[0]}" cluster info | grep -q 'cluster_state:ok' && break
  sleep 0.1
done

run() { # label, shards
  local rules="$TMP/rules-$2" grpc http pid
  mkdir -p "$rules"
  local split=""
  [ "$2" -gt 1 ] && split=", shards: $2"
  printf 'domain: bench\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 1000000000, algorithm: token_bucket%s}\n' \
    "$split" >"$rules/rules.yaml"
  grpc="127.0.0.1:$(free_port)"
  http="127.0.0.1:$(free_port)"
  "$BIN" serve --config "$rules" --grpc-addr "$grpc" --http-addr "$http" --debug-addr 127.0.0.1:0 \
    --backend redis --redis-type cluster --redis-url "$(IFS=,; echo "${NODES[*]}")" \
    --redis-timeout 1s --log-level warn &
  pid=$!
  PIDS+=("$pid")
  for _ in $(seq 200); do curl -sf "http://$http/healthcheck" >/dev/null && break; sleep 0.05; done
  local result
  result="$("$LOADGEN" --target "$grpc" --domain bench --key tenant --keys 1 \
    --duration "${SECONDS_PER_RUN}s" --warmup 2s --json)"
  echo "$1: $(jq -r '"\(.rps | floor) calls/s, p50 \(.latency_ms.p50) ms, p99 \(.latency_ms.p99) ms, errors \(.errors)"' <<<"$result")"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

run "one hot key, one slot          " 1
run "one hot key, shards: 8 (8 slots)" 8
