#!/bin/bash
cd /tmp/scale/proj
export DVC_NO_ANALYTICS=1
rm -rf artifacts/ckpt/pretrain
l=$(date +%s.%N)
setsid dvc repro -f -s pretrain > /tmp/scale/repro_pretrain1.log 2>&1 &
pid=$!
python /tmp/scale/watch2.py $l 0 > /tmp/scale/watch1.txt
while [ ! -f artifacts/ckpt/pretrain/last.pt ]; do sleep 0.05; done
kill -9 -- -$pid; wait $pid
ck=$(python -c "import torch; print(torch.load('artifacts/ckpt/pretrain/last.pt', weights_only=False)['step'])")
echo "killed after checkpoint step $ck; rows: $(tail -n +2 reports/pretrain/loss.tsv | cut -f1 | tr '\n' ' ')" > /tmp/scale/kill.txt
l=$(date +%s.%N)
setsid dvc repro pretrain > /tmp/scale/repro_pretrain2.log 2>&1 &
pid=$!
python /tmp/scale/watch2.py $l $ck > /tmp/scale/watch2.txt
wait $pid
echo rc=$? >> /tmp/scale/kill.txt
