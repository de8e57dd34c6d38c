#!/bin/bash
# Where the d20 training micro-step's time goes, per backend, in one process (bench/train_step.py):
# the micro-step's median and range over ITERS micro-steps, each backend's ratio to the first, the
# optimizer step, peak memory, and a kernel breakdown of one profiled micro-step (GEMMs, FP8 GEMMs,
# TE's kernels, compiled elementwise work, attention).
#   bash bench/gpu/step_breakdown.sh [VARIANT...]     (default: bf16 fp8 te-fp8; see bench/train_step.py)
# te-fp8 needs Transformer Engine (`pip install -e '.[te]'`). Environment: ITERS (8), OUT
# (/tmp/sparkchat-bench/step_breakdown). About 4 minutes on an H200.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/sparkchat-bench/step_breakdown}
mkdir -p "$OUT"
# TE may load an older system cuDNN than torch's; torch's own first
cudnn=$(python3 -c 'import nvidia.cudnn as c, os; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null) \
  && export LD_LIBRARY_PATH=$cudnn${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
# 32 sequences, halved until a step fits this GPU (model/memory_fit.py: 32 does not fit an 80 GB H100)
BATCH=${BATCH:-$(python3 -m bench.fit_batch --depth 20 --seq-len 2048 --vocab 65536 --batch 32)} || exit 1
python3 -m bench.train_step --depth 20 --batch "$BATCH" --no-attention --iters "${ITERS:-8}" --out "$OUT" \
  --variants ${@:-bf16 fp8 te-fp8} 2>&1 | grep -v -i warn | tee "$OUT/train_step.log"
