#!/bin/bash
# H200: pretrain -> midtrain -> sft under native fp8 (profile h200-small: fp8's defaults, i.e. dynamic
# power-of-two scales, cast kernel, fused MLPs)
# on the data and tokenizer that `dvc repro prepare tokenizer` made on the CPU machine (carried in
# artifacts/); the model comes back in parts under $OUT for the CPU server to load.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sed -i 's/^profile: ""/profile: h200-small/' params.yaml
# FP8_CAST=kernel|inline / FP8_SCALING=dynamic|delayed: params.yaml's precision.fp8 options (a
# profile's own settings would win; h200-small sets none)
[ -n "$FP8_CAST" ] && sed -i "s/^    cast: [a-z]* /    cast: $FP8_CAST /" params.yaml
[ -n "$FP8_SCALING" ] && sed -i "s/^    scaling: [a-z]* /    scaling: $FP8_SCALING /" params.yaml
grep -A5 '^  fp8:' params.yaml
[ -n "$EPOCHS" ] && sed -i "s/epochs: 2.0/epochs: $EPOCHS/" profiles/h200-small.yaml
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
for s in ${STAGES:-pretrain midtrain sft}; do
  start=$(date +%s)
  python3 -m pipeline.$s 2>&1 | tr '\r' '\n' | grep -v '^\s*$' > $OUT/$s.log
  rc=$?; echo "$s rc=$rc $(( $(date +%s) - start ))s"; grep -v 'step/s' $OUT/$s.log | tail -4
  grep 'step/s' $OUT/$s.log | tail -1
  [ $rc -eq 0 ] || exit 1
done
tar -cf /tmp/model.tar -C artifacts model pretrain/metrics.json midtrain/metrics.json sft/metrics.json
split -b 15M /tmp/model.tar $OUT/model.tar.part
ls -la $OUT
