#!/usr/bin/env bash
# Start the Dagster UI (port 3000) and the MLflow UI (port 5000) over Kiln's local history; Ctrl-C stops both.
set -euo pipefail
BIN=$1; HOME_DIR=$2
mkdir -p "$DAGSTER_HOME" "$HOME_DIR/mlartifacts"
"$BIN/mlflow" ui --backend-store-uri "sqlite:///$HOME_DIR/mlflow.db" --default-artifact-root "file://$HOME_DIR/mlartifacts" \
  --host 127.0.0.1 --port 5000 --workers 1 &
MLFLOW_PID=$!
trap 'kill $MLFLOW_PID 2>/dev/null' EXIT
"$BIN/dagster" dev -w workspace.yaml -h 127.0.0.1 -p 3000
