#!/usr/bin/env bash
# Start the Dagster UI (port 3000) and the MLflow UI (port 5000) over Kiln's local history; Ctrl-C stops both and
# every process they started, as does a signal that ends only its parent (make) or a SIGKILL of the script.
# Usage: DAGSTER_HOME=... bash scripts/ui.sh VENV_BIN KILN_HOME (make ui does this).
# DAGSTER_PORT / MLFLOW_PORT move the ports. MLflow's background job workers stay off unless
# MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true is set.
set -euo pipefail
set -m  # each server in a process group of its own, so that stopping one group stops all of its children
BIN=$1; HOME_DIR=$2
export KILN_HOME=$HOME_DIR  # the home jobs.definitions binds (its resources, the launchpad's recorded preset)
DAGSTER_PORT=${DAGSTER_PORT:-3000}; MLFLOW_PORT=${MLFLOW_PORT:-5000}
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
mkdir -p "$DAGSTER_HOME" "$HOME_DIR/mlartifacts"
GROUPS_STARTED=()

stop() {  # TERM every process group, give them 10 s, then KILL what is left
  trap - INT TERM EXIT
  if [ -n "${WATCHER:-}" ]; then kill -TERM -- "-$WATCHER" 2>/dev/null || true; fi
  for g in "${GROUPS_STARTED[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for g in "${GROUPS_STARTED[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.2
  done
  for g in "${GROUPS_STARTED[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
}
trap 'stop; exit 130' INT TERM
trap stop EXIT
PARENT=$PPID; SCRIPT=$$

watch() {  # the parent gone (a signal to make's pid alone: make does not pass it on) or this script killed: stop
  while kill -0 "$PARENT" 2>/dev/null && kill -0 "$SCRIPT" 2>/dev/null; do sleep 1; done
  stop
}

"$BIN/python" -m jobs.home "$HOME_DIR"  # a new home's databases, created once before two servers open them at once
"$BIN/mlflow" ui --backend-store-uri "sqlite:///$HOME_DIR/mlflow.db" --default-artifact-root "file://$HOME_DIR/mlartifacts" \
  --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 &
GROUPS_STARTED+=($!)
"$BIN/dagster" dev -w workspace.yaml -h 127.0.0.1 -p "$DAGSTER_PORT" &
GROUPS_STARTED+=($!)
watch &
WATCHER=$!
echo "Dagster at http://127.0.0.1:$DAGSTER_PORT, MLflow at http://127.0.0.1:$MLFLOW_PORT (Ctrl-C stops both)"
wait -n  # when either server exits, the EXIT trap stops the other
