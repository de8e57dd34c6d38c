#!/bin/bash
# H200 call 1: stage TE part 0, smoke every backend that runs without TE, probe d20 bf16 + fp8 (200 steps).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /root/stage && cp .gpu-stage/core/tecore.part00 /root/stage/ && ls -la /root/stage
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
python3 -m pipeline.probe --steps 10 --depth 2 --seq-len 256 --batch 8 --vocab 4096 \
  --backends bf16 fp8 fp8-emulated nvfp4-emulated --out /tmp/smoke > $OUT/smoke.log 2>&1
tail -12 $OUT/smoke.log
timeout 480 python3 -m pipeline.probe --steps 200 --depth 20 --seq-len 2048 --batch 32 --vocab 65536 --backends bf16 fp8 --out $OUT/d20a > $OUT/d20a.log 2>&1
tail -25 $OUT/d20a.log
