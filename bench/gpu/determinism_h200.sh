#!/bin/bash
# H200: is the CUDA-graph engine bitwise repeatable? (issue 17's seeded-sampling flake,
# bench/results/h200-engine-2026-12-04c/README.md). The test's requests three times per engine
# configuration, SDPA alone at 256-1,024 slots, then the compiled prefill, a compiled decode forward
# and graph replays, each repeated on the same inputs.
# Device call: no carry needed, command `bash bench/gpu/determinism_h200.sh` (about 3 minutes).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
. bench/gpu/quiet.sh
python3 bench/gpu/seeded_probe.py 2>&1 | quiet | tee "$OUT/seeded_probe.log"
python3 bench/gpu/attn_det.py 2>&1 | quiet | tee "$OUT/attn_det.log"
python3 bench/gpu/det_probe.py 2>&1 | quiet | tee "$OUT/det_probe.log"
