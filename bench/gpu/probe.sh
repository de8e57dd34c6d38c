#!/bin/bash
# The d20 probe, repeated (bench/probe_spread.py): every backend's micro-step and whole-step tokens/s,
# speedup and loss difference against bf16 of the same run, as the median and range of RUNS runs.
# About 7 minutes a run on an H200 (compile included), so one call may not hold all three: the runs
# land in OUT/run-<i>/ as they finish, and `python -m bench.probe_spread --summarise OUT/run-*/probe.json
# --out OUT` summarises what is there.
#   bash bench/gpu/probe.sh [BACKEND...]     (default: bf16 fp8 te-fp8:delayed)
# te-fp8 needs Transformer Engine (`pip install -e '.[te]'`); without it the entry is reported as
# unavailable, with the reason. Environment: RUNS (3), STEPS (200), DEPTH (20), BATCH (32, or the most that
fits this GPU), OUT (/tmp/sparkchat-bench/probe).
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/sparkchat-bench/probe}
# TE may load an older system cuDNN than torch's; torch's own first
cudnn=$(python3 -c 'import nvidia.cudnn as c, os; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null) \
  && export LD_LIBRARY_PATH=$cudnn${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
# 32 sequences, halved until a step fits this GPU (model/memory_fit.py: d20's 32 does not fit an 80 GB H100)
BATCH=${BATCH:-$(python3 -m bench.fit_batch --depth "${DEPTH:-20}" --seq-len 2048 --vocab 65536 --batch 32)} || exit 1
echo "batch $BATCH"
python3 -m bench.probe_spread --runs "${RUNS:-3}" --out "$OUT" -- --steps "${STEPS:-200}" --depth "${DEPTH:-20}" --seq-len 2048 \
  --batch "$BATCH" --vocab 65536 --backends ${@:-bf16 fp8 te-fp8:delayed} 2>&1 | grep -v -i warn
