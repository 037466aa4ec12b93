#!/usr/bin/env bash
# `make run`: Redis (a local redis-server unless REDIS_URL is set), the API and one worker.
# Settings: the environment, then .env for what the environment leaves unset (.env.example lists
# every one, with PORT, HOST and REDIS_PORT, which only this script reads). Ctrl-C stops them all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

# .env (or ENV_FILE) as the API and worker read it (pydantic-settings): KEY=VALUE lines, the environment wins.
ENV_FILE=${ENV_FILE:-.env}
if [ -f "$ENV_FILE" ]; then
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in '' | '#'*) continue ;; esac
    key=${line%%=*} value=${line#*=}
    [[ "$key" =~ ^[A-Z_][A-Z0-9_]*$ ]] || continue
    value=${value#[\"\']} value=${value%[\"\']}
    [ -n "${!key+set}" ] || export "$key=$value"
  done <"$ENV_FILE"
fi

HOST=${HOST:-127.0.0.1}
if [ -z "${API_KEYS:-}" ] && [ "$HOST" != "127.0.0.1" ]; then
  echo "mpjobs: API_KEYS is not set, so the API stays on 127.0.0.1 (not $HOST)" >&2
  HOST=127.0.0.1
fi
PORT=${PORT:-8000}
mkdir -p var/artifacts var/data var/redis var/log

pids=() names=() logs=()
stop() { trap - EXIT INT TERM; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM

start() { # NAME LOG COMMAND...: run COMMAND in the background, its output in LOG
  local name=$1 log=$2
  shift 2
  "$@" >"$log" 2>&1 &
  pids+=($!) names+=("$name") logs+=("$log")
}

ended() { # INDEX: say that process INDEX exited, with its code and its own last lines; then fail
  local code=0
  wait "${pids[$1]}" || code=$?
  echo "mpjobs: ${names[$1]} exited (code $code); stopping the stack. The last lines of ${logs[$1]}:" >&2
  tail -n 15 "${logs[$1]}" | sed 's/^/    /' >&2
  exit 1
}

all_alive() { # fails (through `ended`) as soon as one of the stack's processes has exited
  local i
  for i in "${!pids[@]}"; do kill -0 "${pids[$i]}" 2>/dev/null || ended "$i"; done
}

# Every port is checked before anything starts: one already taken is named with its program.
"$PY" scripts/port_owner.py "$HOST" "$PORT" "the API" || exit 1
if [ -z "${REDIS_URL:-}" ]; then
  if ! command -v redis-server >/dev/null; then
    echo "mpjobs: installing Debian's redis-server" >&2
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  if [ -n "${REDIS_PORT:-}" ]; then
    "$PY" scripts/port_owner.py 127.0.0.1 "$REDIS_PORT" "redis-server" || exit 1
    redis_port=$REDIS_PORT
  else
    redis_port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  fi
  start redis-server var/log/redis.log redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$PWD/var/redis" \
    --save "" --appendonly yes --appendfsync everysec --maxmemory-policy noeviction
  # Ready when the redis-server answering on the port is the one started here, not another.
  ours() { [ "$(redis-cli -p "$redis_port" info server 2>/dev/null | tr -d '\r' | sed -n 's/^process_id://p')" = "${pids[0]}" ]; }
  for _ in $(seq 100); do all_alive; ours && break; sleep 0.1; done
  ours || { echo "mpjobs: redis-server did not answer on port $redis_port within 10 s; see var/log/redis.log" >&2; exit 1; }
  export REDIS_URL="redis://127.0.0.1:$redis_port/0"
  echo "mpjobs: local redis-server at $REDIS_URL (data in var/redis)"
fi

start "the API" var/log/api.log "$PY" -m uvicorn app.main:app --host "$HOST" --port "$PORT"
start "the worker" var/log/worker.log "$PY" -m worker

base="http://$HOST:$PORT"
# /readyz with the first of API_KEYS when they are set (it answers 401 without one).
ready() {
  "$PY" -c 'import os, sys, urllib.request
key = os.environ.get("API_KEYS", "").split(",")[0].partition(":")[0].strip()
request = urllib.request.Request(sys.argv[1] + "/readyz", headers={"Authorization": f"Bearer {key}"} if key else {})
urllib.request.urlopen(request, timeout=2)' "$base" 2>/dev/null
}
for _ in $(seq 300); do all_alive; ready && break; sleep 0.2; done
all_alive
ready || { echo "mpjobs: the stack did not become ready within 60 s; see var/log/" >&2; exit 1; }
cat <<TXT
mpjobs: API at $base (docs at $base/docs), one worker, logs in var/log/.
Submit a job and follow its metrics:

  ID=\$(curl -s -X POST $base/jobs -H 'content-type: application/json' -d @examples/mlp_mixed_float16.json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])') && curl -N $base/jobs/\$ID/metrics/stream

TXT
# Polled: bash's `wait -n PID...` skips a child that exited before it was called (between the
# last check and here) and would wait on for the others.
while :; do all_alive; sleep 0.5; done
