#!/usr/bin/env bash
# turnstile's instructions per call, counted by callgrind: a count, not a time, so two builds
# compare even on a host whose CPU times move by more than the change between them (the
# Redis side has scripts/script_cost.sh). Each build serves the fixed window's load (64 calls
# in flight over 2 connections, 100 000 keys, one descriptor per call, a limit never reached)
# on the memory backend and on Redis, under callgrind; after a warm-up it counts every thread's
# instructions for a few seconds and divides by the calls answered meanwhile (turnstile's own
# hit counter). Valgrind runs one thread at a time and slows turnstile about fifty times, so
# its calls come in larger batches than at full speed: the figure compares builds, it is not
# the instructions of a call at full speed. Two rounds per build and backend, in turn.
#
# Usage: scripts/turnstile_cost.sh [LABEL=BINARY ...]   (default: this build's release binary)
# Needs valgrind (callgrind_control), redis-server, redis-cli, curl and python3. It starts its
# own redis-server and turnstile processes on free loopback ports and stops them by PID.
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in valgrind callgrind_control redis-server redis-cli curl python3; do
  command -v "$tool" >/dev/null || { echo "turnstile_cost.sh needs $tool" >&2; exit 1; }
done
cargo build --release --quiet -p turnstile-bench
LOADGEN="$PWD/target/release/turnstile-bench"
BUILDS=("$@")
if [ "${#BUILDS[@]}" = 0 ]; then
  cargo build --release --quiet --bin turnstile
  BUILDS=("this build=$PWD/target/release/turnstile")
fi

# shellcheck source=scripts/processes.sh
. scripts/processes.sh
trap 'exit 130' INT TERM
fixed_window_rules "$TMP/rules"

# hits HTTP: the calls turnstile has decided so far (one descriptor each).
hits() {
  curl -s "http://$1/metrics" |
    awk '/^ratelimit_service_rate_limit_total_hits/ {n += $2} END {printf "%d\n", n}'
}

# cost BINARY BACKEND: instructions per call.
cost() {
  local bin="$1" backend="$2" redis_port grpc http out ts_pid load_pid before after
  redis_port="$(free_port)" grpc="127.0.0.1:$(free_port)" http="127.0.0.1:$(free_port)"
  out="$TMP/callgrind.out"
  rm -f "$out"*
  start_redis "$redis_port"
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" \
    "$bin" serve --config "$TMP/rules" --backend "$backend" \
    --redis-url "redis://127.0.0.1:$redis_port" --grpc-addr "$grpc" --http-addr "$http" \
    --log-level warn >"$TMP/turnstile.log" 2>&1 &
  ts_pid=$!
  PIDS+=("$ts_pid")
  for _ in $(seq 300); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$http/healthcheck")" = 200 ] && break
    sleep 0.1
  done
  "$LOADGEN" --target "$grpc" --concurrency 64 --connections 2 --key fw --keys 100000 \
    --duration 20s --warmup 1s --threads 1 --json >/dev/null 2>&1 &
  load_pid=$!
  PIDS+=("$load_pid")
  sleep 6
  before="$(hits "$http")"
  callgrind_control -i on "$ts_pid" >/dev/null 2>&1
  sleep 8
  callgrind_control -i off "$ts_pid" >/dev/null 2>&1
  after="$(hits "$http")"
  callgrind_control -d "$ts_pid" >/dev/null 2>&1
  wait "$load_pid" || true
  kill "$ts_pid" "$REDIS_PID"
  wait "$ts_pid" "$REDIS_PID" 2>/dev/null || true
  PIDS=()
  awk -v calls=$((after - before)) '/^totals:/ {n += $2}
    END {if (calls > 0) printf "%.1fk (%d calls)\n", n / calls / 1000, calls; else print "no calls"}' \
    "$out"*
}

# label BUILD: LABEL of LABEL=BINARY, else the binary's path.
label() { if [ "${1%%=*}" = "$1" ]; then printf '%s' "$1"; else printf '%s' "${1%%=*}"; fi; }

printf '| build | backend | turnstile instructions per call (each round, calls counted) |\n'
printf '|---|---|---|\n'
for backend in memory redis; do
  declare -A rounds=()
  for round in 1 2; do
    for build in "${BUILDS[@]}"; do
      name="$(label "$build")"
      rounds[$name]+="${rounds[$name]:+ · }$(cost "${build#*=}" "$backend")"
    done
  done
  for build in "${BUILDS[@]}"; do
    name="$(label "$build")"
    printf '| %s | %s | %s |\n' "$name" "$backend" "${rounds[$name]}"
  done
  unset rounds
done
