#!/usr/bin/env bash
# A costly client beside a light one, on the Redis backend: does the light one still get its
# answers in time while the costly one keeps Redis busy?
#
#   scripts/bench_costly_client.sh [seconds per run, default 8]
#   BENCH_BASELINE=LABEL=PATH,... scripts/bench_costly_client.sh   (earlier builds, in turn)
#
# The costly client: 64 descriptors of about 3.9 KB each per request (the default request
# bounds allow 64 of 4 096 bytes), 2 generator threads, 64 calls in flight over 8 connections,
# closed loop. The light client: one short descriptor per request, open loop at 2 000
# calls/s (latency from each call's due time), 64 in flight at most over one connection.
# Each build runs the light client alone, then beside the costly one; the builds run in
# turn (A B A B). Both clients are `turnstile-bench`. It starts its own redis-server (free
# loopback port, no persistence) and one turnstile per run, prints one line per client and
# run, and stops every process it started (by PID), on failure too.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_RUN="${1:-8}"
ROUNDS=2
LIGHT_RATE=2000

cargo build --release --quiet --workspace
BUILDS=("this=target/release/turnstile")
IFS=',' read -ra baselines <<<"${BENCH_BASELINE:-}"
for b in "${baselines[@]}"; do
  [ -n "$b" ] || continue
  case "$b" in *=*) BUILDS=("$b" "${BUILDS[@]}") ;; *) BUILDS=("baseline=$b" "${BUILDS[@]}") ;; esac
done
LOADGEN=target/release/turnstile-bench
# shellcheck source=scripts/processes.sh
. scripts/processes.sh

REDIS_PORT="$(free_port)"
start_redis "$REDIS_PORT"

fixed_window_rules "$TMP/rules"
PADDING="$(head -c 3900 /dev/zero | tr '\0' x)"

# client NAME JSON: one line of a client's results.
client() {
  jq -r --arg name "$1" '"    \($name): \(.rps|floor)/s  p50 \(.latency_ms.p50) ms  p99 \(.latency_ms.p99) ms  ok+over \(.ok + .over_limit)  errors \(.errors)"' "$2"
}

# run LABEL BIN COSTLY(0|1): one turnstile, the light client (and the costly one beside it).
run() {
  local label="$1" bin="$2" costly="$3" grpc http ts costly_pid=""
  redis-cli -p "$REDIS_PORT" flushall >/dev/null
  grpc="127.0.0.1:$(free_port)" http="127.0.0.1:$(free_port)"
  "$bin" serve --config "$TMP/rules" --grpc-addr "$grpc" --http-addr "$http" --backend redis \
    --redis-url "redis://127.0.0.1:$REDIS_PORT" --log-level warn >>"$TMP/turnstile.log" 2>&1 &
  ts=$!
  PIDS+=("$ts")
  for _ in $(seq 200); do curl -sf -o /dev/null "http://$http/healthcheck" && break; sleep 0.05; done
  if [ "$costly" = 1 ]; then
    "$LOADGEN" --target "$grpc" --concurrency 64 --connections 8 --threads 2 --key fw \
      --keys 100000 --descriptors 64 --value-prefix "$PADDING" \
      --duration "$((SECONDS_PER_RUN + 3))s" --warmup 0s --json >"$TMP/costly.json" &
    costly_pid=$!
    PIDS+=("$costly_pid")
    sleep 2
  fi
  "$LOADGEN" --target "$grpc" --concurrency 64 --connections 1 --threads 1 --key fw \
    --keys 1000 --rate "$LIGHT_RATE" --duration "${SECONDS_PER_RUN}s" --warmup 0s \
    --json >"$TMP/light.json"
  [ -z "$costly_pid" ] || wait "$costly_pid"
  local errors breaker
  errors="$(curl -s "http://$http/metrics" | awk -F'[{}"]' \
    '/^ratelimit_service_should_rate_limit_error\{/ && $NF+0 > 0 {printf "%s %d, ", $3, $NF}')"
  breaker="$(curl -s "http://$http/metrics" | awk '/^turnstile_backend_circuit_transitions/ {n += $NF} END {print n+0}')"
  echo "  $label, $([ "$costly" = 1 ] && echo "beside the costly client" || echo "alone"):"
  client light "$TMP/light.json"
  [ "$costly" = 0 ] || client costly "$TMP/costly.json"
  echo "    server: errors by kind: ${errors:-none}; breaker transitions: $breaker"
  kill "$ts"
  wait "$ts" 2>/dev/null || true
}

echo "costly client beside a light one (Redis backend, ${SECONDS_PER_RUN} s per run)"
for round in $(seq "$ROUNDS"); do
  echo "round $round"
  for build in "${BUILDS[@]}"; do
    run "${build%%=*}" "${build#*=}" 0
    run "${build%%=*}" "${build#*=}" 1
  done
done
