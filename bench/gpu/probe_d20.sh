#!/bin/bash
# H200: the d20 probe (200 steps, 64k tokens per micro-step). Call 1 (carries TE's small part and the
# last core part): bf16 + fp8. Calls 2-5 carry the other core parts. Call 6: install TE, TE recipes.
#   bash bench/gpu/probe_d20.sh plain [BACKEND...] | bash bench/gpu/probe_d20.sh te BACKEND...
# (plain: bf16 fp8 unless backends are named; it also stages TE's parts when they were carried)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mode=$1; shift
if [ "$mode" = plain ]; then
  mkdir -p /root/stage && cp .gpu-stage/small/* .gpu-stage/core/tecore.part04 /root/stage/ 2>/dev/null
  timeout 560 python3 -m pipeline.probe --steps 200 --depth 20 --seq-len 2048 --batch 32 --vocab 65536 --backends ${@:-bf16 fp8} --out $OUT/probe 2>&1 \
    | grep -v -i warn | tee $OUT/probe.log
else
  # installed once per machine: a second TE call on the still-warm machine goes straight to the probe
  [ -f /root/stage/installed ] || { bash /root/stage/te-install.sh /root/stage 2>&1 | grep TE_SMOKE && touch /root/stage/installed; }
  # TE loads an older system cuDNN; torch's own first (shared/gpu/README.md)
  export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.cudnn as c,os;print(os.path.join(list(c.__path__)[0],"lib"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  timeout 540 python3 -m pipeline.probe --steps 200 --depth 20 --seq-len 2048 --batch 32 --vocab 65536 --backends "$@" --out $OUT/probe 2>&1 \
    | grep -v -i warn | tee $OUT/probe.log
fi
