#!/bin/bash
# The GPU decode path: the GPU engine tests (greedy ids of the graph path against the eager one,
# seeded sampling repeatable, ...) and FP8 serving weights' (tests/test_fp8_weights_gpu.py), the FP8
# weight products' tiles against bf16 (bench/fp8_gemv.py), then
# bench/serve_gpu.py: the engine alone and through the HTTP API at 1, 16, 64 and 128 streams, d20
# shape, bf16, random weights (its flags pass through: "$@"), then bench/serve_client.py: bf16 and fp8
# weights alternated in each of 3 rounds (an engine and a server each; one after the other on a card
# under 120 GB), closed-loop streams and Poisson rates through the openai client beside the engine alone, the floor, transformers at one stream; its
# raw JSON checked for the headline keys (bench/check_keys.py). CLIENT=0 leaves the client run out.
#   bash bench/gpu/serve.sh [BENCH FLAGS...]     Environment: OUT (/tmp/sparkchat-bench/serve), CLIENT (1).
#   SPARKCHAT_TRAINED_MODEL=DIR adds a trained model of your own to the FP8 greedy-ids test.
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
python3 -m pytest -q -p no:warnings tests/test_fp8_weights_gpu.py 2>&1 | tail -5 | tee "$OUT/fp8_weights_gpu_tests.log"
python3 -m bench.fp8_gemv --out "$OUT/fp8_gemv.json" 2>&1 | grep -v -i warn | tee "$OUT/fp8_gemv.log"
python3 -m bench.serve_gpu --http --out "$OUT/serve_gpu.json" "$@" 2>&1 | grep -v -i warn | tee "$OUT/serve_gpu.log"
if [ "${CLIENT:-1}" != 0 ]; then
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  # bf16 and fp8 side by side hold four d20 caches of 128 x 2,048 slots (an engine and a server each, about
  # 27 GB a cache): on a card under 120 GB they run one after the other, each with its own raw file
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${MEM:-0}" -ge 120000 ]; then RUNS="bf16,fp8"; else RUNS="bf16 fp8"; fi
  PEER=--peer
  FILES=()
  for w in $RUNS; do
    f="$OUT/serve_client_${COMMIT}_${w/,/_}.json"
    python3 -m bench.serve_client --weights "$w" --rounds 3 $PEER --serve-args=--no-ui --out "$f" 2>&1 \
      | grep -v -i warn | tee -a "$OUT/serve_client.log"
    FILES+=("$f")
    PEER=
  done
  python3 -m bench.check_keys "${FILES[@]}" 2>&1 | tee -a "$OUT/serve_client.log"
fi
