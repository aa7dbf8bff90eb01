#!/usr/bin/env bash
# Redis instructions per decision of the batch script, counted by callgrind: a count, not a
# time, so it repeats whatever else the machine is doing. For each algorithm, one-hit
# requests in calls of 1, 10 and 64 (fixed window) or 1 and 16 requests, with tickets as
# long as turnstile's, over 1 000 keys (the keys exist after the warm-up, so the count is
# the decisions', not the keyspace's growth); and the fixed window's calls of 10 and 64 on
# one hot key, every request of a call on one counter; each as turnstile runs it on Redis 7,
# a function of its library (FCALL), and as it runs on a server without functions, by hash
# (EVALSHA), where every call makes the twins anew. Then, for the fixed window's calls,
# what part is Redis's own: the same calls to a script that returns at once (reading the
# values, running a script, replying), and to one that only runs INCRBY once per key.
#
# Usage: scripts/script_cost.sh [TURNSTILE_BINARY]   (default: this build's release binary)
# Needs valgrind (callgrind_control), redis-server, redis-benchmark and redis-cli. It starts
# its own redis-server under valgrind on a free loopback port per case and stops it by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/batch_call.sh
. scripts/batch_call.sh

BIN="${1:-}"
if [ -z "$BIN" ]; then
  cargo build --release --quiet --bin turnstile
  BIN="$PWD/target/release/turnstile"
fi
for tool in valgrind callgrind_control redis-server redis-benchmark redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "script_cost.sh needs $tool" >&2; exit 1; }
done

TMP="$(mktemp -d)"
VG_PID=""
cleanup() {
  [ -n "$VG_PID" ] && kill "$VG_PID" 2>/dev/null && wait "$VG_PID" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
"$BIN" redis-script >"$TMP/batch.lua" 2>/dev/null
"$BIN" redis-script --library >"$TMP/library.lua" 2>"$TMP/function"
# A deadline as long as a real one (16 digits of microseconds), far past any test.
DEADLINE=9999999999999999
DECISIONS=20000

# Stand-ins for the batch script, taking the same KEYS and ARGV.
printf 'return 1\n' >"$TMP/nothing.lua"
printf "for i = 1, #KEYS do redis.call('INCRBY', KEYS[i], '1') end\nreturn 1\n" >"$TMP/incrby.lua"

# cost RULE PER_CALL [SCRIPT] [KEYS]: instructions per decision (SCRIPT: the batch script's
# file name in TMP by default, library.lua for its function library; KEYS: 1 000 by default).
cost() {
  local rule="$1" per_call="$2" script="${3:-batch.lua}" keys="${4:-1000}" port sha verb args
  local out total
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  out="$TMP/callgrind.$rule.$per_call.$script.$keys"
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --logfile "$TMP/redis.log" --daemonize no >"$TMP/valgrind.log" 2>&1 &
  VG_PID=$!
  for _ in $(seq 200); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.1; done
  if [ "$script" = library.lua ]; then
    redis-cli -p "$port" -x FUNCTION LOAD <"$TMP/$script" >/dev/null
    verb=FCALL sha="$(cat "$TMP/function")"
  else
    verb=EVALSHA sha="$(redis-cli -p "$port" -x SCRIPT LOAD <"$TMP/$script")"
  fi
  mapfile -t args < <(evalsha_args "$rule" "$keys" "$per_call" "$DEADLINE")
  bench() { redis-benchmark -p "$port" -c 1 -P 16 -r 1000 -n "$1" "$verb" "$sha" "${args[@]}" >/dev/null; }
  bench 3000
  callgrind_control -i on "$VG_PID" >/dev/null 2>&1
  bench $((DECISIONS / per_call))
  callgrind_control -d "$VG_PID" >/dev/null 2>&1
  for _ in $(seq 100); do compgen -G "$out.*" >/dev/null && break; sleep 0.1; done
  kill "$VG_PID"
  wait "$VG_PID" 2>/dev/null || true
  VG_PID=""
  total="$(awk '/^(summary|totals):/ {print $2; exit}' "$out".*)"
  python3 -c "print(f'{$total / ($DECISIONS // $per_call * $per_call) / 1000:.1f}')"
}

printf '| algorithm | keys | requests per call | Redis instructions per decision, FCALL | EVALSHA |\n'
printf '|---|---:|---:|---:|---:|\n'
for case in "fw 1 1000" "fw 10 1000" "fw 64 1000" "fw 10 1" "fw 64 1" "tb 1 1000" \
  "tb 16 1000" "sw 1 1000" "sw 16 1000"; do
  read -r rule per_call keys <<<"$case"
  printf '| %s | %s | %s | %sk | %sk |\n' "${CALL_ALGO[$rule]}" "$keys" "$per_call" \
    "$(cost "$rule" "$per_call" library.lua "$keys")" "$(cost "$rule" "$per_call" batch.lua "$keys")"
done
printf '\n| the fixed window'"'"'s call, to a script that | requests per call | Redis instructions per request |\n|---|---:|---:|\n'
for per_call in 1 10 64; do
  printf '| returns at once | %s | %sk |\n' "$per_call" "$(cost fw "$per_call" nothing.lua)"
done
printf '| runs one INCRBY per key | 10 | %sk |\n' "$(cost fw 10 incrby.lua)"
