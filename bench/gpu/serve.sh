#!/bin/bash
# The GPU decode path: the GPU engine tests (greedy ids of the graph path against the eager one,
# seeded sampling repeatable, ...), then bench/serve_gpu.py: the engine alone and through the HTTP API
# at 1, 16, 64 and 128 streams, d20 shape, bf16, random weights (its flags pass through: "$@").
#   bash bench/gpu/serve.sh [BENCH FLAGS...]     Environment: OUT (/tmp/sparkchat-bench/serve).
# On a host without network, build the wheels of bench/gpu/wheels.txt into .whl/ first; they are
# installed from there when present.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/sparkchat-bench/serve}
SITE=${SCRATCH:-/tmp}/sparkchat-site
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$SITE
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -m pytest -q -x -p no:warnings tests/test_engine_gpu.py 2>&1 | tail -3 | tee "$OUT/engine_gpu_tests.log"
python3 -m bench.serve_gpu --http --out "$OUT/serve_gpu.json" "$@" 2>&1 | grep -v -i warn | tee "$OUT/serve_gpu.log"
