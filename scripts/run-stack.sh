#!/usr/bin/env bash
# `make run`: Redis (a local redis-server unless REDIS_URL is set), the API and one worker.
# Ctrl-C stops all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
HOST=${HOST:-127.0.0.1}
if [ -z "${API_KEYS:-}" ] && [ "$HOST" != "127.0.0.1" ]; then
  echo "mpjobs: API_KEYS is not set, so the API stays on 127.0.0.1 (not $HOST)" >&2
  HOST=127.0.0.1
fi
PORT=${PORT:-8000}
mkdir -p var/artifacts var/data var/redis var/log

pids=()
stop() { trap - EXIT INT TERM; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM

if [ -z "${REDIS_URL:-}" ]; then
  if ! command -v redis-server >/dev/null; then
    echo "mpjobs: installing Debian's redis-server" >&2
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  redis_port=${REDIS_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
  redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$PWD/var/redis" --save "" \
    --appendonly yes --appendfsync everysec --maxmemory-policy noeviction >var/log/redis.log 2>&1 &
  pids+=($!)
  export REDIS_URL="redis://127.0.0.1:$redis_port/0"
  for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  echo "mpjobs: local redis-server at $REDIS_URL (data in var/redis)"
fi

"$PY" -m uvicorn app.main:app --host "$HOST" --port "$PORT" >var/log/api.log 2>&1 &
pids+=($!)
"$PY" -m worker >var/log/worker.log 2>&1 &
pids+=($!)

base="http://$HOST:$PORT"
ready() { "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/readyz", timeout=2)' "$base" 2>/dev/null; }
for _ in $(seq 300); do ready && break; sleep 0.2; done
ready || { echo "mpjobs: the stack did not become ready; see var/log/" >&2; exit 1; }
cat <<TXT
mpjobs: API at $base (docs at $base/docs), one worker, logs in var/log/.
Submit a job and follow its metrics:

  ID=\$(curl -s -X POST $base/jobs -H 'content-type: application/json' -d @examples/mlp_mixed_float16.json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])') && curl -N $base/jobs/\$ID/metrics/stream

TXT
wait -n "${pids[@]}"
echo "mpjobs: a process exited; stopping the stack (see var/log/)" >&2
exit 1
