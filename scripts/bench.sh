#!/usr/bin/env bash
# Measures turnstile on this machine, in one run (BENCHMARKS.md explains the figures):
#   a. throughput and latency at 64 concurrent calls, key cardinality 1 and 100 000, each
#      algorithm, memory and Redis backends (plus one run where nearly every answer is
#      OVER_LIMIT);
#   a2. Redis coalescing A/B: 64 in flight with --redis-batch 1 and the default, then 256 and
#      512 in flight counting errors;
#   a3. the Redis I/O thread's scheduler slice A/B: the default and the kernel's, in turn;
#   a4. Redis bounded and evicting (docs/redis.md, Memory): no maxmemory, a bound not reached,
#      and one reached (every new counter evicts one), in turn;
#   b. the Redis ceiling: redis-benchmark running the same FCALL of the real batch script's
#      function (`turnstile redis-script --library`) against the same Redis, one request per
#      call, pipelined like turnstile's multiplexed connections;
#   c. p99 at 50% of the peak rate, open loop (latency from each call's due time), 3 runs;
#      then again with the service on one core and the generator on another (`taskset`), at
#      half of the peak measured so; and, before any load, the host's own pauses: a thread
#      spinning alone on each CPU, timing the gaps in its run;
#   d. Redis bytes per limit for each algorithm at 100 000 keys, and turnstile's RSS at
#      100 000 live keys on the memory backend;
#   d2. RLQS streams that never read their answers: turnstile's RSS at the peak and after
#      (this build and the BENCH_BASELINE builds that serve RLQS, in turn);
#   e. rule matching cost on a 10 000-rule set (criterion, benches/matcher.rs);
#   f. before/after: with BENCH_BASELINE=<turnstile binaries built from earlier commits, as
#      LABEL=PATH, comma-separated> (a bare PATH is labelled "baseline"; the label "issue"
#      names the build issue 15 measured as "today", 4fa4128, which its targets are then
#      also read against), those binaries and this build in turn, same load, same run, at
#      100 000 keys and at the load issue 15 measured (1 000 keys over 4 connections; this
#      build alone without baselines); and a fleet: 4 instances sharing one Redis (total
#      decisions/s, Redis CPU per decision); on Redis the same before/after again with
#      turnstile and Redis on one core and the generator on another (`taskset`);
#   g. a window's end: errors and Redis's longest expire cycle while a minute's counters
#      expire (this build, 20 s across a minute's end);
#   h. beside the Rust peer: with BENCH_PEER=limitador=<a limitador-server binary, built
#      from Kuadrant/limitador apart from this repository>, it and this build in turn, same
#      generator and Redis, the fixed window's load on each backend.
#
# It builds release, starts its own redis-server (free loopback port, never 6379, no
# persistence) and turnstile processes, and stops every one of them by PID when it ends, on
# failure too. Results go to target/bench/<time>/ (results.jsonl, summary.md).
#
# Usage: scripts/bench.sh [--quick] [--profile] [--update-doc]
#   --quick       shorter runs (about 5 minutes instead of about 10, builds included)
#   --profile     also record perf profiles of turnstile under load (perf must work)
#   --update-doc  write the figures into BENCHMARKS.md
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0 PROFILE=0 UPDATE_DOC=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --profile) PROFILE=1 ;;
    --update-doc) UPDATE_DOC=1 ;;
    -h | --help) sed -n '2,44p' "$0"; exit 0 ;;
    *) echo "unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

for tool in redis-server redis-cli redis-benchmark jq curl python3; do
  command -v "$tool" >/dev/null || { echo "bench.sh needs $tool" >&2; exit 1; }
done

if [ "$QUICK" = 1 ]; then
  DURATION=3s WARMUP=1s CRITERION=(--quick)
else
  DURATION=8s WARMUP=1s CRITERION=(--warm-up-time 1 --measurement-time 3)
fi
CONCURRENCY=64
CONNECTIONS=2
# Ceiling: redis-benchmark over as many connections as turnstile's Redis pool (2), each
# pipelining half of the 64 calls in flight, as turnstile's multiplexing does.
REDIS_POOL=2
PIPELINE=$((CONCURRENCY / REDIS_POOL))
BIG=100000

OUT="target/bench/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
# TMP, PIDS and their cleanup on exit, and free_port.
# shellcheck source=scripts/processes.sh
. scripts/processes.sh
trap 'exit 130' INT TERM

log() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Stop one process we started, by PID.
stop() {
  local pid="$1" keep=() p
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  for p in "${PIDS[@]}"; do [ "$p" = "$pid" ] || keep+=("$p"); done
  PIDS=("${keep[@]}")
}

# ---------------------------------------------------------------------------------------
log "building release"
cargo build --release --quiet --workspace
BIN="$PWD/target/release/turnstile"
LOADGEN="$PWD/target/release/turnstile-bench"

# ---------------------------------------------------------------------------------------
# Redis: a private server on a free port, no persistence.
REDIS_PORT="$(free_port)"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --dir "$TMP" --logfile "$TMP/redis.log" --daemonize no &
PIDS+=($!)
REDIS_PID=$!
rcli() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }
for _ in $(seq 100); do rcli PING >/dev/null 2>&1 && break; sleep 0.05; done
rcli PING >/dev/null || { cat "$TMP/redis.log" >&2; exit 1; }
redis_cpus="$(taskset -p -c "$REDIS_PID" 2>/dev/null | awk '{print $NF}')"
log "redis-server $(redis-server --version | awk '{print $3}') on 127.0.0.1:$REDIS_PORT (pid $REDIS_PID)"

# The batch script from the binary, exactly as turnstile runs it on Redis 7: its function
# library (the function's name on stderr). Loading it here also checks that turnstile then
# finds it by that name.
"$BIN" redis-script --library >"$TMP/library.lua" 2>"$TMP/function"
FUNCTION="$(tr -d '[:space:]' <"$TMP/function")"
loaded="$(rcli -x FUNCTION LOAD <"$TMP/library.lua")"
[ "$loaded" = "$FUNCTION" ] ||
  { echo "FUNCTION LOAD gave $loaded, turnstile calls $FUNCTION" >&2; exit 1; }

# ---------------------------------------------------------------------------------------
# Rules. Limits are high enough that answers are real admissions (state read and written),
# except `over` (nearly every answer OVER_LIMIT) and the sliding window, whose limit is
# capped at 10 000 per window. The *h rules use hour windows so state stays live for the
# memory measurements.
RULES="$TMP/rules"
mkdir -p "$RULES"
cat >"$RULES/bench.yaml" <<'EOF'
domain: bench
descriptors:
  - key: fw
    rate_limit: {unit: minute, requests_per_unit: 1000000000}
  - key: sw
    rate_limit: {unit: second, requests_per_unit: 10000, algorithm: sliding_window}
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 1, burst: 1000000000, algorithm: token_bucket}
  - key: over
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: fwh
    rate_limit: {unit: hour, requests_per_unit: 1000000}
  - key: swh
    rate_limit: {unit: hour, requests_per_unit: 100, algorithm: sliding_window}
  - key: tbh
    rate_limit: {unit: hour, requests_per_unit: 1, burst: 10, algorithm: token_bucket}
EOF
# RLQS buckets (section d2): each `user` id its own limited bucket.
cat >"$RULES/rlqs.yaml" <<'EOF'
domain: rlqs
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 100}
EOF
"$BIN" check --config "$RULES" >/dev/null
# The batch script's call for the ceiling (SPEC, evalsha_args) and the algorithms of
# its rules fw, sw and tb (CALL_ALGO), shared with script_cost.sh.
# shellcheck source=scripts/batch_call.sh
. scripts/batch_call.sh
# Every rule's algorithm: the call's rules, then the others.
declare -A ALGO=([over]=fixed_window [fwh]=fixed_window [swh]=sliding_window
  [tbh]=token_bucket)
for rule in "${!CALL_ALGO[@]}"; do ALGO[$rule]="${CALL_ALGO[$rule]}"; done

# With two CPUs or more (and taskset), some loads run again with the service (turnstile and
# its Redis) on the first CPU of $cpus and the generator on the second; Redis then goes back
# to $redis_cpus.
mapfile -t cpus < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
one_core=0
[ "${#cpus[@]}" -ge 2 ] && command -v taskset >/dev/null && one_core=1

# c0. The host's own pauses, before any load: on a VM the host takes a virtual CPU away, and
#     its kernel's threads run (DAMON's kdamond, for one), for milliseconds at a time, which a
#     p99 of 2 ms at tens of thousands of calls a second cannot absorb. A thread spinning
#     alone on each CPU for $PAUSE_SECONDS s reads the clock and keeps the gaps over half a
#     millisecond: time it was not running (a turn of its loop takes well under a microsecond).
PAUSE_SECONDS=10
[ "$QUICK" = 1 ] && PAUSE_SECONDS=3
log "the host's pauses: a thread spinning on each CPU for $PAUSE_SECONDS s"
spinners=()
for cpu in "${cpus[@]}"; do
  pin=()
  command -v taskset >/dev/null && pin=(taskset -c "$cpu")
  # Not in PIDS: each ends on its own after $PAUSE_SECONDS s.
  "${pin[@]}" python3 - "$cpu" "$PAUSE_SECONDS" >"$TMP/pauses-$cpu.json" <<'EOF' &
import json, sys, time
cpu, seconds = int(sys.argv[1]), float(sys.argv[2])
clock = time.perf_counter
last = clock()
end, gaps = last + seconds, []
while last < end:
    now = clock()
    if now - last > 0.0005:
        gaps.append(now - last)
    last = now
print(json.dumps({"name": f"host/pauses/{cpu}", "cpu": cpu, "seconds": seconds,
                  "over_1_ms": sum(g > 0.001 for g in gaps),
                  "over_2_ms": sum(g > 0.002 for g in gaps),
                  "longest_ms": round(max(gaps, default=0.0) * 1e3, 3),
                  "lost_ms": round(sum(gaps) * 1e3, 3)}))
EOF
  spinners+=($!)
done
for pid in "${spinners[@]}"; do wait "$pid"; done
for cpu in "${cpus[@]}"; do
  tee -a "$RESULTS" <"$TMP/pauses-$cpu.json" |
    jq -r '"  CPU \(.cpu): \(.over_1_ms) pauses over 1 ms, \(.over_2_ms) over 2 ms, longest \(.longest_ms) ms"' >&2
done

TS_PID="" GRPC=""
# await_healthy URL WHAT LOG: wait until the server just started ($TS_PID) answers URL with
# 200; if it exits or never does, say so (pointing at LOG) and stop the run.
await_healthy() {
  for _ in $(seq 200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ] && return 0
    kill -0 "$TS_PID" 2>/dev/null || break
    sleep 0.05
  done
  echo "$2 did not become healthy; see $3" >&2
  exit 1
}

# start_turnstile BACKEND [serve options...]: the binary is $TS_BIN (default: this build's);
# with ON_CPU set, it runs on that CPU alone.
start_turnstile() {
  local http backend="$1" pin=()
  shift
  [ -n "${ON_CPU:-}" ] && pin=(taskset -c "$ON_CPU")
  GRPC="127.0.0.1:$(free_port)"
  http="127.0.0.1:$(free_port)"
  "${pin[@]}" "${TS_BIN:-$BIN}" serve --config "$RULES" --grpc-addr "$GRPC" --http-addr "$http" \
    --backend "$backend" --redis-url "redis://127.0.0.1:$REDIS_PORT" --log-level warn "$@" \
    >>"$OUT/turnstile.log" 2>&1 &
  TS_PID=$!
  TS_HTTP="$http"
  PIDS+=("$TS_PID")
  await_healthy "http://$http/healthcheck" "turnstile ($backend)" "$OUT/turnstile.log"
}

# start_one_core BACKEND [serve options...]: start_turnstile on the first CPU of $cpus, with
# Redis moved there too on the Redis backend; stop_one_core stops it and gives Redis back
# $redis_cpus. The generator goes on the second CPU (LOAD_CPU).
start_one_core() {
  [ "$1" = redis ] && taskset -a -p -c "${cpus[0]}" "$REDIS_PID" >/dev/null
  ON_CPU="${cpus[0]}" start_turnstile "$@"
}
stop_one_core() {
  stop "$TS_PID"
  taskset -a -p -c "$redis_cpus" "$REDIS_PID" >/dev/null
}

rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

# load NAME BACKEND RULE KEYS [extra bench args...]: one load run, appended to results; with
# LOAD_CPU set, the generator runs on that CPU alone.
load() {
  local name="$1" backend="$2" rule="$3" keys="$4" pin=()
  shift 4
  local watch="${WATCH_AS:-turnstile}=$TS_PID"
  [ "$backend" = redis ] && watch="$watch,redis=$REDIS_PID"
  [ -n "${LOAD_CPU:-}" ] && pin=(taskset -c "$LOAD_CPU")
  "${pin[@]}" "$LOADGEN" --target "$GRPC" --concurrency "${LOAD_CONCURRENCY:-$CONCURRENCY}" \
    --connections "${LOAD_CONNECTIONS:-$CONNECTIONS}" \
    --key "$rule" --keys "$keys" --duration "${LOAD_DURATION:-$DURATION}" \
    --warmup "${LOAD_WARMUP:-$WARMUP}" --threads 1 \
    --watch-pid "$watch" --json "$@" >"$TMP/run.json"
  jq -c --arg name "$name" --arg backend "$backend" --arg rule "$rule" \
    --arg algorithm "${ALGO[$rule]}" \
    '. + {name: $name, backend: $backend, rule: $rule, algorithm: $algorithm}' \
    "$TMP/run.json" | tee -a "$RESULTS" |
    jq -r '"  \(.name): \(.rps|floor)/s  p50 \(.latency_ms.p50) ms  p99 \(.latency_ms.p99) ms  p99.9 \(.latency_ms.p99_9) ms  ok \(.ok) over \(.over_limit) err \(.errors)  cpu us/call \(.cpu_us_per_call)"' >&2
}

# half_peak_runs BACKEND NAME PEAK_RUN: three open-loop runs (fixed window, 100 000 keys) at
# half the calls/s of the run named PEAK_RUN, named BACKEND/NAME/100000/1..3. At most 64 in
# flight, many times what the rate needs; a call that waits for a place still counts its
# wait, since latency runs from its due time.
half_peak_runs() {
  local backend="$1" name="$2" peak rate run
  peak="$(jq -r --arg n "$3" 'select(.name == $n) | .rps' "$RESULTS")"
  rate="$(python3 -c "print(round($peak / 2))")"
  for run in 1 2 3; do
    [ "$backend" = redis ] && rcli FLUSHALL >/dev/null
    load "$backend/$name/$BIG/$run" "$backend" fw "$BIG" --rate "$rate"
  done
}

profile() { # NAME: record turnstile while the next load runs
  [ "$PROFILE" = 1 ] || return 0
  perf record -F 499 --call-graph dwarf,16384 -p "$TS_PID" -o "$OUT/perf-$1.data" -- sleep 3 \
    >/dev/null 2>&1 &
  PIDS+=($!)
  PERF_PID=$!
}
profile_done() { # NAME
  [ "$PROFILE" = 1 ] || return 0
  wait "$PERF_PID" 2>/dev/null || true
  stop "$PERF_PID"
  # Self time, then time including callees (inlined frames left out).
  {
    echo "## self"
    perf report -i "$OUT/perf-$1.data" --no-children --sort dso,symbol --stdio -g none \
      2>/dev/null | grep -E '^ +[0-9]' | head -40
    echo "## with callees"
    perf report -i "$OUT/perf-$1.data" --children --sort symbol --stdio -g none 2>/dev/null |
      grep -E '^ +[0-9]' | grep -v '(inlined)' | head -150
  } | sed -E 's/ +$//' >"$OUT/perf-$1.txt" || true
  rm -f "$OUT/perf-$1.data"
  log "profile: $OUT/perf-$1.txt"
}

# ---------------------------------------------------------------------------------------
# a. Throughput at 64 concurrent calls.
for backend in memory redis; do
  start_turnstile "$backend"
  log "turnstile $backend backend (pid $TS_PID) on $GRPC"
  for rule in fw sw tb; do
    for keys in 1 "$BIG"; do
      [ "$backend" = redis ] && rcli FLUSHALL >/dev/null
      if [ "$rule" = fw ] && [ "$keys" = "$BIG" ]; then profile "$backend"; fi
      load "$backend/${ALGO[$rule]}/$keys" "$backend" "$rule" "$keys"
      if [ "$rule" = fw ] && [ "$keys" = "$BIG" ]; then profile_done "$backend"; fi
    done
  done
  [ "$backend" = redis ] && rcli FLUSHALL >/dev/null
  load "$backend/over_limit/1" "$backend" over 1
  # Four descriptors per call: four decisions, one backend step.
  [ "$backend" = redis ] && rcli FLUSHALL >/dev/null
  load "$backend/fixed_window_4d/$BIG" "$backend" fw "$BIG" --descriptors 4

  # c. p99 at 50% of the peak (fixed window, 100 000 keys), open loop, three runs: on shared
  #    cores one stall of a few ms sets a run's p99, which then moves far from run to run.
  half_peak_runs "$backend" open_loop_50pct "$backend/fixed_window/$BIG"
  stop "$TS_PID"

  # c2. The same with the service on one core and the generator on the other, its own peak
  #     first: sharing both cores, the generator (about half a core at these rates) and the
  #     service wait for each other's time slices, and a call's latency counts both waits.
  [ "$one_core" = 1 ] || continue
  start_one_core "$backend"
  [ "$backend" = redis ] && rcli FLUSHALL >/dev/null
  LOAD_CPU="${cpus[1]}" load "$backend/peak_one_core/$BIG" "$backend" fw "$BIG"
  LOAD_CPU="${cpus[1]}" half_peak_runs "$backend" open_loop_50pct_one_core \
    "$backend/peak_one_core/$BIG"
  stop_one_core
done

# ---------------------------------------------------------------------------------------
# a2. Coalescing, A/B in one run: the Redis backend at 64 in flight with every request a
#     script call of its own (--redis-batch 1) and with the default batch (Redis CPU per
#     decision is the figure: cpu_us_per_call.redis); then 256 and 512 in flight, counting
#     errors (a healthy Redis must cause none); and at 64 the default batch over one Redis
#     connection (one call in flight instead of two: larger calls).
for batch in 1 default pool1; do
  case "$batch" in
    default) start_turnstile redis ;;
    pool1) start_turnstile redis --redis-connections 1 ;;
    *) start_turnstile redis --redis-batch "$batch" ;;
  esac
  for inflight in 64 256 512; do
    [ "$batch" != default ] && [ "$inflight" != 64 ] && continue
    rcli FLUSHALL >/dev/null
    LOAD_CONCURRENCY="$inflight" load "redis_batch_$batch/fixed_window/$BIG/c$inflight" redis fw "$BIG"
  done
  stop "$TS_PID"
done

# a3. The Redis I/O thread's scheduler slice, A/B in one run: the Redis backend at 64 in
#     flight sharing the cores, with the default slice (100 µs) and the kernel's own
#     (--redis-io-slice 0) in turn, three rounds each: one pair moves with the host by more
#     than the change does.
for round in 1 2 3; do
  for slice in default kernel; do
    case "$slice" in
      default) start_turnstile redis ;;
      kernel) start_turnstile redis --redis-io-slice 0 ;;
    esac
    rcli FLUSHALL >/dev/null
    load "io_slice/$slice/$round" redis fw "$BIG"
    stop "$TS_PID"
  done
done

# a4. Redis bounded and evicting, as docs/redis.md asks of a Redis in production, against
#     Redis as every other row runs it (no maxmemory): a bound of 256 MB, which 100 000
#     counters do not reach, and one of 8 MB, which they do (past it, nearly every new
#     counter evicts one), both volatile-lru; in turn, two rounds. Redis' evictions during
#     each run are recorded beside it.
start_turnstile redis
for round in 1 2; do
  for bound in none 256mb 8mb; do
    case "$bound" in
      none) rcli CONFIG SET maxmemory 0 >/dev/null ;;
      *) rcli CONFIG SET maxmemory "$bound" maxmemory-policy volatile-lru >/dev/null ;;
    esac
    rcli FLUSHALL >/dev/null
    evicted_before="$(rcli INFO stats | awk -F: '/^evicted_keys:/ {print $2+0}')"
    load "redis_memory/$bound/$round" redis fw "$BIG"
    evicted_after="$(rcli INFO stats | awk -F: '/^evicted_keys:/ {print $2+0}')"
    jq -cn --arg name "redis_memory/$bound/$round/evicted" \
      --argjson evicted "$((evicted_after - evicted_before))" \
      '{name: $name, evicted: $evicted}' >>"$RESULTS"
  done
done
rcli CONFIG SET maxmemory 0 maxmemory-policy noeviction >/dev/null
stop "$TS_PID"

# ---------------------------------------------------------------------------------------
# b. The ceiling: the same FCALL from redis-benchmark, same Redis, same key shapes.
log "Redis ceiling: redis-benchmark FCALL, $REDIS_POOL connections x pipeline $PIPELINE"
ceiling() { # RULE KEYS REQUESTS [PER_CALL]: calls/s
  local rule="$1" keys="$2" n="$3" per_call="${4:-1}" range args
  range="$([ "$keys" = 1 ] && echo 1000000000 || echo "$keys")"
  mapfile -t args < <(evalsha_args "$rule" "$keys" "$per_call")
  redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -c "$REDIS_POOL" -P "$PIPELINE" -n "$n" \
    -r "$range" --csv FCALL "$FUNCTION" "${args[@]}" |
    tail -1 | cut -d, -f2 | tr -d '"'
}
# The call must be one the script decides, not an error redis-benchmark would count as fast:
# two requests decided (each the hit's remaining and reset) and the time, 5 values.
mapfile -t probe_args < <(evalsha_args fw 1 2)
probe="$(rcli FCALL "$FUNCTION" "${probe_args[@]}")"
[ "$(grep -c . <<<"$probe")" = 5 ] && ! grep -q ERR <<<"$probe" ||
  { echo "the ceiling's FCALL does not decide:" >&2; echo "$probe" >&2; exit 1; }
target_secs=$([ "$QUICK" = 1 ] && echo 2 || echo 4)
for rule in fw sw tb; do
  for keys in 1 "$BIG"; do
    rcli FLUSHALL >/dev/null
    probe="$(ceiling "$rule" "$keys" 20000)"
    n="$(python3 -c "print(max(20000, int($probe * $target_secs)))")"
    rcli FLUSHALL >/dev/null
    rps="$(ceiling "$rule" "$keys" "$n")"
    jq -nc --arg name "ceiling/${ALGO[$rule]}/$keys" --arg algorithm "${ALGO[$rule]}" \
      --argjson keys "$keys" --argjson rps "$rps" --argjson n "$n" \
      --argjson c "$REDIS_POOL" --argjson p "$PIPELINE" \
      '{name: $name, backend: "redis-benchmark", algorithm: $algorithm, keys: $keys, rps: $rps,
        calls: $n, connections: $c, pipeline: $p}' | tee -a "$RESULTS" |
      jq -r '"  \(.name): \(.rps|floor)/s"' >&2
  done
done

# b2. Redis CPU per decision by requests per call (fixed window, 100 000 keys): what
#     coalescing can save at best, on Redis' side.
redis_cpu_us() { rcli INFO cpu | awk -F: '/^used_cpu_(sys|user):/ {s += $2} END {printf "%.0f", s * 1e6}'; }
for per_call in 1 4 16 64; do
  rcli FLUSHALL >/dev/null
  n=$((200000 / per_call))
  before="$(redis_cpu_us)"
  rps="$(ceiling fw "$BIG" "$n" "$per_call")"
  after="$(redis_cpu_us)"
  jq -nc --arg name "batch_ceiling/fixed_window/$per_call" --argjson per_call "$per_call" \
    --argjson rps "$rps" --argjson n "$n" --argjson cpu "$((after - before))" \
    '{name: $name, backend: "redis-benchmark", algorithm: "fixed_window", per_call: $per_call,
      calls_per_s: $rps, decisions_per_s: ($rps * $per_call),
      redis_cpu_us_per_decision: ($cpu / ($n * $per_call) * 10 | round / 10)}' |
    tee -a "$RESULTS" |
    jq -r '"  \(.name): \(.decisions_per_s|floor) decisions/s, Redis \(.redis_cpu_us_per_decision) us/decision"' >&2
done

# ---------------------------------------------------------------------------------------
# d. Memory: Redis bytes per limit, and turnstile RSS at 100 000 live keys (memory backend).
prefill() { # NAME BACKEND RULE
  LOAD_WARMUP=0s LOAD_DURATION=60s \
    load "$1" "$2" "$3" "$BIG" --key-order sequential --requests "$BIG"
}
log "memory at $BIG keys"
start_turnstile redis
for rule in fwh swh tbh; do
  rcli FLUSHALL >/dev/null
  before="$(rcli INFO memory | awk -F: '/^used_memory:/ {print $2+0}')"
  prefill "redis/prefill/${ALGO[$rule]}" redis "$rule"
  after="$(rcli INFO memory | awk -F: '/^used_memory:/ {print $2+0}')"
  dbsize="$(rcli DBSIZE)"
  sample=0
  while read -r k; do
    [ -n "$k" ] && sample=$((sample + $(rcli MEMORY USAGE "$k" SAMPLES 0)))
  done < <(rcli --scan --pattern "*|$rule=u777|*")
  jq -nc --arg name "redis_memory/${ALGO[$rule]}" --arg algorithm "${ALGO[$rule]}" \
    --argjson limits "$BIG" --argjson keys "$dbsize" --argjson delta "$((after - before))" \
    --argjson sample "$sample" \
    '{name: $name, backend: "redis", algorithm: $algorithm, limits: $limits, redis_keys: $keys,
      used_memory_delta: $delta, bytes_per_limit: ($delta / $limits | floor),
      memory_usage_one_limit: $sample}' | tee -a "$RESULTS" |
    jq -r '"  \(.name): \(.bytes_per_limit) B/limit (used_memory), MEMORY USAGE \(.memory_usage_one_limit) B, \(.redis_keys) keys"' >&2
done
stop "$TS_PID"
rcli FLUSHALL >/dev/null

for rule in fwh swh tbh; do
  start_turnstile memory
  # A first call so the connections and buffers exist before the baseline.
  "$LOADGEN" --target "$GRPC" --key over --keys 1 --duration 1s --warmup 0s --threads 1 \
    --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" --json >/dev/null
  before="$(rss_kb "$TS_PID")"
  prefill "memory/prefill/${ALGO[$rule]}" memory "$rule"
  after="$(rss_kb "$TS_PID")"
  jq -nc --arg name "memory_rss/${ALGO[$rule]}" --arg algorithm "${ALGO[$rule]}" \
    --argjson keys "$BIG" --argjson before "$before" --argjson after "$after" \
    '{name: $name, backend: "memory", algorithm: $algorithm, keys: $keys, rss_before_kb: $before,
      rss_after_kb: $after, bytes_per_key: (($after - $before) * 1024 / $keys | floor)}' |
    tee -a "$RESULTS" |
    jq -r '"  \(.name): RSS \(.rss_before_kb) -> \(.rss_after_kb) kB, \(.bytes_per_key) B/key"' >&2
  stop "$TS_PID"
done

# ---------------------------------------------------------------------------------------
# d2. RLQS streams whose client never reads its answers (memory backend): each of this
#     build and the BENCH_BASELINE builds that serve RLQS, in turn, takes a flood of streams
#     sending reports of about 1 MB (3 500 buckets); turnstile's RSS before, at its peak
#     (read every 0.1 s), and 3 s after the streams close, and the reports it answered. All
#     streams come from one address, so the per-peer cap is raised to the global one.
# The builds: this one, and the baselines (BENCH_BASELINE, LABEL=PATH,...), which section f
# also runs.
declare -A BUILD=([current]="$BIN")
sides=()
IFS=, read -ra baselines <<<"${BENCH_BASELINE:-}"
for baseline in "${baselines[@]}"; do
  label=baseline path="$baseline"
  [[ "$baseline" == *=* ]] && label="${baseline%%=*}" path="${baseline#*=}"
  [ -x "$path" ] || { echo "BENCH_BASELINE: $path is not an executable" >&2; exit 2; }
  [ -z "${BUILD[$label]:-}" ] || { echo "BENCH_BASELINE: $label twice" >&2; exit 2; }
  BUILD[$label]="$path"
  sides+=("$label")
done
flood_sides=(current)
for side in "${sides[@]}"; do
  "${BUILD[$side]}" serve --help | grep -q -- --rlqs-max-streams-per-peer && flood_sides+=("$side")
done
FLOOD_BUCKETS=3500
for flood in "1024 1" "120 6"; do
  read -r streams reports <<<"$flood"
  for side in "${flood_sides[@]}"; do
    log "RLQS flood: $streams streams of $reports reports, $side"
    TS_BIN="${BUILD[$side]}" start_turnstile memory --rlqs-max-streams-per-peer 1024
    before="$(rss_kb "$TS_PID")"
    "$PWD/target/release/turnstile-rlqs-flood" --target "$GRPC" --streams "$streams" \
      --reports "$reports" --buckets "$FLOOD_BUCKETS" --hold 2s >"$TMP/flood.json" &
    flood_pid=$!
    PIDS+=("$flood_pid")
    peak="$before"
    while kill -0 "$flood_pid" 2>/dev/null; do
      now="$(rss_kb "$TS_PID")"
      [ "$now" -gt "$peak" ] && peak="$now"
      sleep 0.1
    done
    stop "$flood_pid"
    sleep 3
    after="$(rss_kb "$TS_PID")"
    answered="$(curl -fsS "http://$TS_HTTP/metrics" |
      awk -v buckets="$FLOOD_BUCKETS" '/^turnstile_rlqs_bucket_reports / {print int($2 / buckets)}')"
    jq -c --arg name "rlqs_flood/$streams/$reports/$side" --arg build "$side" \
      --argjson reports "$reports" --argjson before "$before" --argjson peak "$peak" \
      --argjson after "$after" --argjson answered "${answered:-0}" \
      '{name: $name, build: $build, streams: .streams, opened: .opened, reports: $reports,
        rss_before_kb: $before, rss_peak_kb: $peak, rss_after_kb: $after,
        reports_answered: $answered}' "$TMP/flood.json" | tee -a "$RESULTS" |
      jq -r '"  \(.name): RSS \(.rss_before_kb) -> peak \(.rss_peak_kb) -> \(.rss_after_kb) kB, \(.reports_answered) reports answered"' >&2
    stop "$TS_PID"
  done
done

# ---------------------------------------------------------------------------------------
# f. Before/after in one run: the baselines and this build alternate (A B A B), so a drift
#    in the machine's load hits all alike; and, with or without baselines, the load issue 15
#    measured and set its targets at (1 000 keys over 4 connections; the runs above use 2
#    connections and 1 or 100 000 keys).
# Each load: its runs' name, keys and connections.
loads=("ab_issue_load 1000 4")
[ "${#sides[@]}" -gt 0 ] && loads=("ab $BIG $CONNECTIONS" "${loads[@]}")
# The same loads with a core for the service and another for the generator (Redis backend,
# given two CPUs): turnstile and Redis on the first, the generator on the second. Sharing
# both cores, the generator's own CPU per call takes a share that no build of the service can
# win back, so ratios of calls/s between builds there understate what a build changed; here
# each build has one core for itself and its Redis, as a deployment gives the service CPUs
# of its own. Not the memory backend: with a core of its own turnstile outruns the generator.
one_core_loads=()
if [ "$one_core" = 1 ]; then
  for each in "${loads[@]}"; do one_core_loads+=("${each/ab/ab_one_core}"); done
fi
# run_loads BACKEND SIDE ROUND LOAD...: the loads against the turnstile just started.
run_loads() {
  local backend="$1" side="$2" round="$3" each prefix keys connections
  shift 3
  for each in "$@"; do
    read -r prefix keys connections <<<"$each"
    [ "$backend" = redis ] && rcli FLUSHALL >/dev/null
    LOAD_CONNECTIONS="$connections" load "$prefix/$backend/$side/$round" "$backend" fw "$keys"
  done
}
sides+=(current)
log "before/after: ${sides[*]}"
for backend in memory redis; do
  for round in 1 2; do
    for side in "${sides[@]}"; do
      TS_BIN="${BUILD[$side]}" start_turnstile "$backend"
      run_loads "$backend" "$side" "$round" "${loads[@]}"
      stop "$TS_PID"
      [ "$backend" = redis ] && [ "${#one_core_loads[@]}" -gt 0 ] || continue
      TS_BIN="${BUILD[$side]}" start_one_core redis
      LOAD_CPU="${cpus[1]}" run_loads redis "$side" "$round" "${one_core_loads[@]}"
      stop_one_core
    done
  done
done

# h. Beside the Rust peer, limitador, with a limit like the rule fw (10^9 a minute per value
#    of the descriptor key fw): it and this build in turn (A B A B), each watched as
#    "server", on the memory backend and on the same Redis, 1 key and 100 000.
if [ -n "${BENCH_PEER:-}" ]; then
  peer="${BENCH_PEER#limitador=}"
  [ "$peer" != "$BENCH_PEER" ] && [ -x "$peer" ] ||
    { echo "BENCH_PEER: limitador=PATH, PATH a limitador-server binary" >&2; exit 2; }
  cat >"$TMP/limitador.yaml" <<'EOF'
- namespace: bench
  max_value: 1000000000
  seconds: 60
  conditions: []
  variables:
    - descriptors[0].fw
EOF
  log "beside the peer: $("$peer" --version 2>/dev/null | head -1)"
  start_peer() { # BACKEND
    local storage=(memory) http_port
    [ "$1" = redis ] && storage=(redis "redis://127.0.0.1:$REDIS_PORT")
    GRPC="127.0.0.1:$(free_port)"
    http_port="$(free_port)"
    RUST_LOG=error "$peer" -b 127.0.0.1 -p "${GRPC#*:}" -B 127.0.0.1 -P "$http_port" \
      "$TMP/limitador.yaml" "${storage[@]}" >>"$OUT/limitador.log" 2>&1 &
    TS_PID=$!
    PIDS+=("$TS_PID")
    await_healthy "http://127.0.0.1:$http_port/status" "limitador ($1)" "$OUT/limitador.log"
  }
  for backend in memory redis; do
    for keys in 1 "$BIG"; do
      for round in 1 2; do
        for side in current limitador; do
          if [ "$side" = current ]; then start_turnstile "$backend"; else start_peer "$backend"; fi
          [ "$backend" = redis ] && rcli FLUSHALL >/dev/null
          WATCH_AS=server load "peer/$backend/$side/$keys/$round" "$backend" fw "$keys"
          stop "$TS_PID"
        done
      done
    done
  done
fi

# g. A window's end: fixed-window counters made in one minute expire after it ends, which
#    must not stall Redis (its expiry deletes keys in cycles of up to 25 ms). This build runs
#    20 s from 15 s before a minute's end, with Redis's latency monitor on; its longest
#    expire cycle is recorded beside the load.
rcli CONFIG SET latency-monitor-threshold 1 >/dev/null
start_turnstile redis
sleep $(((105 - $(date +%s) % 60) % 60))
log "a window's end"
rcli FLUSHALL >/dev/null
rcli LATENCY RESET >/dev/null
# Its record gets the longest cycle before it joins the results.
RESULTS="$TMP/rollover.jsonl" LOAD_WARMUP=0s LOAD_DURATION=20s \
  load "rollover/current" redis fw "$BIG"
stall="$(rcli LATENCY LATEST | awk 'found == 1 && ++n == 3 {print; exit} $0 == "expire-cycle" {found = 1}')"
jq -c --arg stall "${stall:-0}" '. + {expire_cycle_max_ms: ($stall | tonumber)}' \
  "$TMP/rollover.jsonl" >>"$RESULTS"
log "  longest expire cycle: ${stall:-0} ms"
stop "$TS_PID"
rcli CONFIG SET latency-monitor-threshold 0 >/dev/null

# A fleet: FLEET instances on one Redis, the load spread over them (one connection each, 64
# calls in flight in all). Redis CPU per decision is what sizes a fleet: one Redis core
# serves 10^6 / (µs per decision) decisions/s.
FLEET=4
log "fleet: $FLEET instances on one Redis"
fleet_targets=() fleet_watch="redis=$REDIS_PID"
for i in $(seq "$FLEET"); do
  start_turnstile redis
  fleet_targets+=("$GRPC")
  fleet_watch="$fleet_watch,turnstile$i=$TS_PID"
done
rcli FLUSHALL >/dev/null
"$LOADGEN" --target "$(IFS=,; echo "${fleet_targets[*]}")" --concurrency "$CONCURRENCY" \
  --connections 1 --key fw --keys "$BIG" --duration "$DURATION" --warmup "$WARMUP" \
  --threads 1 --watch-pid "$fleet_watch" --json >"$TMP/run.json"
jq -c --argjson instances "$FLEET" \
  '. + {name: "fleet/redis/fixed_window", backend: "redis", rule: "fw",
        algorithm: "fixed_window", instances: $instances}' "$TMP/run.json" |
  tee -a "$RESULTS" |
  jq -r '"  \(.name): \(.instances) instances, \(.rps|floor)/s, err \(.errors), redis cpu us/call \(.cpu_us_per_call.redis)"' >&2
for pid in "${PIDS[@]}"; do
  [ "$pid" = "$REDIS_PID" ] || stop "$pid"
done
rcli FLUSHALL >/dev/null

# ---------------------------------------------------------------------------------------
# e. Rule matching on 10 000 rules.
log "criterion: benches/matcher.rs"
cargo bench --quiet --bench matcher -- "${CRITERION[@]}" >"$OUT/criterion.txt" 2>&1 ||
  { cat "$OUT/criterion.txt" >&2; exit 1; }
for est in target/criterion/*/*/new/estimates.json; do
  bench="$(basename "$(dirname "$(dirname "$est")")")"
  group="$(basename "$(dirname "$(dirname "$(dirname "$est")")")")"
  jq -c --arg name "criterion/$group/$bench" \
    '{name: $name, backend: "criterion", mean_ns: (.mean.point_estimate | floor),
      median_ns: (.median.point_estimate | floor)}' "$est" | tee -a "$RESULTS" |
    jq -r '"  \(.name): \(.median_ns) ns"' >&2
done

# ---------------------------------------------------------------------------------------
python3 scripts/bench_report.py "$RESULTS" $([ "$QUICK" = 1 ] && echo --quick) \
  >"$OUT/summary.md"
cat "$OUT/summary.md"
if [ "$UPDATE_DOC" = 1 ]; then
  python3 scripts/bench_report.py "$RESULTS" --update BENCHMARKS.md \
    $([ "$QUICK" = 1 ] && echo --quick)
  log "BENCHMARKS.md updated"
fi
log "results in $OUT"
