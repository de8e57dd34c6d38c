#!/bin/bash
# H200, one call of ~7 minutes: the cost of sharding on one GPU at d20 (bench/fsdp.py). bf16 and fp8, each
# trained 200 steps without a wrapper and under FSDP2 as `runtime.parallel: fsdp` runs it (loss after 200
# steps compared, 0.5% allowed), then 40 steps under DDP (one rank of DDP computes what no wrapper does:
# speed only). 16 x 2048 tokens a step, synthetic Markov tokens, every block compiled on its own in every
# mode (FSDP needs that, so the ratio is the sharding alone; COMPILE=stage compiles none/ddp whole, as the
# training stage does, which adds about a minute of compile per run).
#
# Device call: nothing to carry; command `bash bench/gpu/fsdp_h200.sh`. Needs only torch (2.11 there),
# Triton (fp8's cast kernel) and pyyaml, which the image has.
# Settings (environment): STEPS (200), BATCH (16), BACKENDS ("bf16 fp8"), MODES ("none fsdp ddp": run in
# that order, each over every backend), COMPILE (regional | stage), LIMIT (seconds, 570: the JSON is
# rewritten after every run, so a cut-short call keeps the runs that finished).
# Comes back under $OUT: fsdp.json (every run: tokens/s, forward+backward ms, peak memory, compile s, losses
# every 10 steps, speed and loss against the unwrapped run), fsdp.log (the log and the summary table).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader 2>/dev/null
timeout "${LIMIT:-570}" python3 -m bench.fsdp --depth 20 --seq-len 2048 --vocab 65536 --batch "${BATCH:-16}" \
  --steps "${STEPS:-200}" --timing-steps 40 --backends ${BACKENDS:-bf16 fp8} --modes ${MODES:-none fsdp ddp} \
  --compile "${COMPILE:-regional}" --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/fsdp.log"
rc=${PIPESTATUS[0]}
echo "bench.fsdp rc=$rc"
exit "$rc"
