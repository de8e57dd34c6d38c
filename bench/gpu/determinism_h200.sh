#!/bin/bash
# H200: is the CUDA-graph engine bitwise repeatable? (issue 17's seeded-sampling flake,
# bench/results/h200-engine-2026-12-04c/README.md). Where runs of the same seeded requests first part
# (with and without a fixed cuBLAS workspace), one decode step repeated on a saved cache, the operator
# that parts, the attention step by step; then (unless LOCATE_ONLY is set) the test's requests three
# times per engine configuration, SDPA alone, and the compiled prefill, decode forward and graph
# replays on fixed inputs. Results: bench/results/h200-determinism-2026-12-04/.
# Device call: no carry needed, command `bash bench/gpu/determinism_h200.sh` (about 9 minutes).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
. bench/gpu/quiet.sh
python3 bench/gpu/seeded_locate.py 2>&1 | quiet | tee "$OUT/seeded_locate.log"
CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 bench/gpu/seeded_locate.py 2>&1 | quiet | tee -a "$OUT/seeded_locate.log"
python3 bench/gpu/replay_stress.py 2>&1 | quiet | tee "$OUT/replay_stress.log"
for a in "" --after-engine --deterministic "--backend cudnn" "--backend efficient" "--backend math" --ops; do
  python3 bench/gpu/op_locate.py $a 2>&1 | quiet | tee -a "$OUT/op_locate.log"
done
python3 bench/gpu/attn_steps.py 2>&1 | quiet | tee "$OUT/attn_steps.log"
[ -n "$LOCATE_ONLY" ] && exit 0
python3 bench/gpu/seeded_probe.py 2>&1 | quiet | tee "$OUT/seeded_probe.log"
python3 bench/gpu/attn_det.py 2>&1 | quiet | tee "$OUT/attn_det.log"
python3 bench/gpu/det_probe.py 2>&1 | quiet | tee "$OUT/det_probe.log"
