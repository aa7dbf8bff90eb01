#!/usr/bin/env bash
# Runs every test of turnstile. The tests start their own redis-server processes on free
# loopback ports (never the machine's own Redis), so redis-server and redis-cli must be
# installed: this script installs them when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "installing redis-server (the tests start their own instances)" >&2
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq redis-server >/dev/null
fi

cargo test "$@"
