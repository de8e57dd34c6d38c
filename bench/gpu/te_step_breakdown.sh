#!/bin/bash
# H200: install TE from /root/stage (its parts staged by the calls before), then where the d20
# micro-step's time goes under each variant, one process (default: bf16, fp8, te-fp8 delayed fused):
# GEMMs, TE's own kernels, compiled elementwise work, and GPU idle.
#   bash bench/gpu/te_step_breakdown.sh [VARIANT...]
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
[ -f /root/stage/installed ] || { bash /root/stage/te-install.sh /root/stage 2>&1 | grep TE_SMOKE | tee $OUT/te_smoke.log && touch /root/stage/installed; }
# TE loads an older system cuDNN; torch's own first (shared/gpu/README.md)
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.cudnn as c,os;print(os.path.join(list(c.__path__)[0],"lib"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
timeout $((585 - SECONDS)) python3 -m bench.train_step --depth 20 --batch 32 --no-attention --iters 5 --out $OUT \
  --variants ${@:-bf16 fp8 te-fp8} 2>&1 | grep -v -i warn | tee $OUT/train_step.log
