# shellcheck shell=bash
# The batch script's call as turnstile sends it (lua/batch.lua has the layout), for the
# benchmark rules fw, sw and tb; sourced by bench.sh and script_cost.sh, so the two send the
# same call.

# The algorithm of each rule, and its limit spec as turnstile sends it (once per call, in the
# call's one value of specs): algorithm, limit, window s, burst, role, then ';'. Limits are
# high enough that answers are real admissions (state read and written); the sliding
# window's is capped at 10 000 per window.
declare -A CALL_ALGO=([fw]=fixed_window [sw]=sliding_window [tb]=token_bucket)
declare -A SPEC=(
  [fw]="fixed_window 1000000000 60 1000000000 e;"
  [sw]="sliding_window 10000 1 10000 e;"
  [tb]="token_bucket 1 1 1000000000 e;"
)

# evalsha_args RULE KEYS PER_CALL [DEADLINE]: the KEYS and ARGV of one call deciding PER_CALL
# requests of one hit each, as coalescing sends them: Redis time, the earliest deadline, the
# one spec, then one run of alike requests: its shape (atomic, one hit of spec 1 costing 1, and
# how many requests it holds), then the requests' tickets in one value (per request a nonce of
# 12 characters, here redis-benchmark's __rand_int__, drawn afresh for each, and a deadline of
# 16 digits). DEADLINE (default 0: none) stands in for the microseconds on Redis' clock that
# turnstile writes; far in the future, it is read as text like a real one but never passes.
evalsha_args() {
  local rule="$1" keys="$2" per_call="$3" deadline="${4:-0}" key i tickets=""
  if [ "$keys" = 1 ]; then
    key="{bench|$rule=u0|${CALL_ALGO[$rule]}}"
  else
    key="{bench|$rule=u__rand_int__|${CALL_ALGO[$rule]}}"
  fi
  printf '%s\n' "$per_call"
  for i in $(seq "$per_call"); do printf '%s\n' "$key"; done
  printf '%s\n' 0 "$deadline" "${SPEC[$rule]}" 1 "a 1:1*$per_call"
  for i in $(seq "$per_call"); do tickets+="$(printf '__rand_int__%016d' "$deadline")"; done
  printf '%s\n' "$tickets"
}
