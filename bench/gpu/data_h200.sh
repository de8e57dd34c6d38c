#!/bin/bash
# H200: the data path under the `h200` profile, through DVC on a fresh clone (pipeline_h200_small_dvc.sh),
# on a corpus generated there (bench/corpus.py), up to pretrain, steps capped: does the memory-mapped
# loader keep the GPU fed at d20 under fp8? Compare pretrain's tokens/s with the probe's whole step at
# the same shape (bench/results/README.md). The chat sources are the built-in ones (no hub), the
# tokenizer trains on 20M characters (the profile's 2G would take the whole call).
# Device call: carry [".whl"], command `bash bench/gpu/data_h200.sh [SIZE]`.
SIZE=${1:-200MB}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD python3 -m bench.corpus --size "$SIZE" --out /tmp/corpus.jsonl || exit 1
ls -la /tmp/corpus.jsonl
PROFILE=h200 DVC_TIMEOUT=${DVC_TIMEOUT:-380} bash bench/gpu/pipeline_h200_small_dvc.sh \
  -S "data.pretrain_sources=['/tmp/corpus.jsonl']" -S 'data.chat_sources=[builtin:synthetic]' \
  -S data.synthetic_train=12000 -S data.synthetic_eval=50 -S tokenizer.train_chars=20000000 \
  -S pretrain.steps=12 -S pretrain.eval_tokens=1048576 -S pretrain.log_every=1 pretrain
