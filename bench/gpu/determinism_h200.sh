#!/bin/bash
# H200: is the CUDA-graph engine bitwise repeatable? (issue 17's seeded-sampling flake). Results and
# what each probe found: bench/results/h200-determinism-2026-12-04/README.md. Three parts, each within
# one device call (the whole is longer than one call allows):
#   locate  where runs of the same seeded requests first part (with and without a fixed cuBLAS
#           workspace), and one decode step repeated on a saved cache (about 4 minutes)
#   ops     the aten operator that parts with equal inputs, then at its position each SDPA kernel and
#           stand-in, and compute-sanitizer's memcheck without the caching allocator (about 4 minutes)
#   probes  the test's requests three times per engine configuration, SDPA alone, and the compiled
#           prefill, decode forward and graph replays on fixed inputs (about 3 minutes)
# Device call: no carry needed, command `bash bench/gpu/determinism_h200.sh locate|ops|probes`.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
. bench/gpu/quiet.sh
case "$1" in
  locate)
    python3 bench/gpu/seeded_locate.py 2>&1 | quiet | tee "$OUT/seeded_locate.log"
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 bench/gpu/seeded_locate.py 2>&1 | quiet | tee -a "$OUT/seeded_locate.log"
    python3 bench/gpu/replay_stress.py 2>&1 | quiet | tee "$OUT/replay_stress.log" ;;
  ops)
    python3 bench/gpu/op_locate.py --ops 2>&1 | quiet | tee "$OUT/op_locate.log"
    for a in "--backend cudnn" "--backend efficient" "--backend math" --explicit-bf16 --pad-q; do
      python3 bench/gpu/op_locate.py --bare --only 602 --repeats 300 $a 2>&1 | quiet | tee -a "$OUT/op_locate.log"
    done
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 bench/gpu/op_locate.py --bare --only 602 --repeats 4 2>&1 | grep -v "Host Frame" > "$OUT/memcheck.log" ;;
  probes)
    python3 bench/gpu/seeded_probe.py 2>&1 | quiet | tee "$OUT/seeded_probe.log"
    python3 bench/gpu/attn_det.py 2>&1 | quiet | tee "$OUT/attn_det.log"
    python3 bench/gpu/det_probe.py 2>&1 | quiet | tee "$OUT/det_probe.log" ;;
  *) echo "usage: bash bench/gpu/determinism_h200.sh locate|ops|probes" >&2; exit 2 ;;
esac
