#!/bin/bash
# sparkchat's pretrain loop against nanochat's base_train on one GPU (bench/vs_nanochat.py): the same token
# stream, depth, batch and sequence length, each with its own optimizer settings; bf16 and each one's FP8,
# RUNS alternated rounds; whole-step tokens/s, sparkchat / nanochat and fp8 / bf16 ratios, val bpb at equal
# training time. Needs nanochat's files in bench/peers/nanochat/ (exported where a mirror is, then carried
# to the GPU host as files: `python -m bench.vs_nanochat export --from <nanochat git dir>`).
#   bash bench/gpu/vs_nanochat.sh                 d12 then d20
# A step is one micro-step of BATCH x 2048 tokens unless TOTAL_BATCH says more (nanochat's d20 default is
# 524,288 tokens a step: about 3.5 s a step at 150k tokens/s, so 1,000 such steps are an hour a run).
# Environment: DEPTHS ("12 20"), STEPS (1000), RUNS (3), BATCH (32: halved to fit the card, the same for
# both), TOTAL_BATCH (BATCH x 2048), EVAL_EVERY (100), PRECISIONS ("bf16 fp8"), TEXT (corpus | shakespeare),
# OUT (/tmp/sparkchat-bench/vs_nanochat): vs_nanochat_d<depth>.json, rewritten after every round.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/sparkchat-bench/vs_nanochat}
mkdir -p "$OUT"
# a host without network: the wheels of bench/gpu/wheels.txt in .whl/ (datasets and pyarrow for the data;
# as bench/gpu/pipeline.sh installs them)
if [ -d .whl ]; then
  SITE=${SCRATCH:-/tmp}/sparkchat-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheel install from .whl/ failed"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:$SITE
fi
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
for depth in ${DEPTHS:-12 20}; do
  batch=$(python3 -m bench.fit_batch --depth "$depth" --seq-len 2048 --vocab 65536 --batch "${BATCH:-32}") || exit 1
  python3 -m bench.vs_nanochat run --depth "$depth" --steps "${STEPS:-1000}" --runs "${RUNS:-3}" --batch "$batch" \
    --total-batch "${TOTAL_BATCH:-$((batch * 2048))}" --eval-every "${EVAL_EVERY:-100}" --precisions ${PRECISIONS:-bf16 fp8} \
    --text "${TEXT:-corpus}" --work "$OUT/work-d$depth" --out "$OUT/vs_nanochat_d$depth.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/vs_nanochat_d$depth.log" || exit 1
done
python3 -m bench.vs_nanochat check "$OUT"/vs_nanochat_d*.json
