#!/usr/bin/env bash
# One-GPU benchmark: GPT-2 124M trained for 100 steps at sequence length 1024 by Kiln's own training step (bf16
# autocast, fused AdamW, the chunked head), eager and then with torch.compile, printing tokens/s and MFU against
# the GPU's dense BF16 peak (and against a bf16 matmul measured in the same run); with two GPUs or more, a llama
# trained tensor-parallel over two of them, then as two pipeline stages (1F1B, then interleaved 1F1B), each beside
# one GPU alone (bench/model_parallel.py).
#
# Run: bash bench/gpu.sh        results also go to $OUT/gpu-eager.json and $OUT/gpu-compile.json (OUT=/tmp/kiln-gpu)
#
# Safe to run unattended: it changes nothing outside $OUT and a private virtualenv under /tmp, asks nothing, and
# stops itself 8 minutes after it starts, install included. It uses the environment's torch when that sees a GPU;
# otherwise it installs torch==2.13.0 (the CUDA build pip picks by default on Linux) into /tmp/kiln-gpu-venv, from
# the wheels in ./.whl when present, else from the package index, within the same time limit.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
LIMIT=${KILN_GPU_BENCH_LIMIT_S:-480}
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
left() { echo $((LIMIT - (SECONDS - START))); }

PY=${PYTHON:-python3}
has_gpu() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
if ! has_gpu "$PY"; then
  VENV=/tmp/kiln-gpu-venv
  if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  if [ -d .whl ]; then PIP+=(--no-index --find-links .whl); fi
  echo "installing torch==2.13.0 with CUDA into $VENV (at most $(left)s)"
  timeout "$(left)" "${PIP[@]}" "torch==2.13.0" numpy pyyaml xxhash \
    || { echo "could not install torch==2.13.0 (no package index and no ./.whl wheels?); nothing measured" >&2; exit 1; }
  PY="$VENV/bin/python"
  has_gpu "$PY" || { echo "no CUDA GPU visible to torch; nothing measured" >&2; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

ARGS=(--device cuda --preset gpt2 --vocab 50304 --seq-len 1024 --micro-batch 16 --steps 100 --warmup 10 --threads 8)
echo "== eager (at most $(left)s)"
timeout "$(left)" "$PY" bench/bench_train.py "${ARGS[@]}" --json "$OUT/gpu-eager.json"
if [ "$(left)" -gt 90 ]; then
  echo "== torch.compile, each block (at most $(left)s, compile time included)"
  timeout "$(left)" "$PY" bench/bench_train.py "${ARGS[@]}" --compile --json "$OUT/gpu-compile.json" \
    || echo "compiled run did not finish in time; the eager figures above stand"
fi
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
SPLIT=(--device cuda --family llama --layers 8 --width 1024 --heads 16 --vocab 32768 --seq-len 1024 --micro-batch 8
       --steps 20 --ranks 2)
if [ "$GPUS" -ge 2 ] && [ "$(left)" -gt 60 ]; then
  echo "== tensor parallelism over 2 GPUs beside one GPU (at most $(left)s)"
  timeout "$(left)" "$PY" bench/model_parallel.py --split tp "${SPLIT[@]}" --json "$OUT/gpu-tp2.json" \
    || echo "the tensor-parallel run did not finish in time"
fi
for SCHEDULE in 1f1b interleaved_1f1b; do
  if [ "$GPUS" -ge 2 ] && [ "$(left)" -gt 60 ]; then
    echo "== two pipeline stages ($SCHEDULE, 4 micro-batches) beside one GPU (at most $(left)s)"
    timeout "$(left)" "$PY" bench/model_parallel.py --split pp --schedule "$SCHEDULE" --microbatches 4 "${SPLIT[@]}" \
      --json "$OUT/gpu-pp2-$SCHEDULE.json" || echo "the pipeline run ($SCHEDULE) did not finish in time"
  fi
done
echo "done in $((SECONDS - START))s; results in $OUT"
