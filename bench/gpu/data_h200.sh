#!/bin/bash
# H200: the data path under the `h200` profile, through DVC on a fresh clone (pipeline_h200_small_dvc.sh),
# on a corpus generated there (bench/corpus.py), up to pretrain, steps capped: does the memory-mapped
# loader keep the GPU fed at d20 under fp8? Compare pretrain's tokens/s with the probe's whole step at
# the same shape (bench/results/README.md). A profile's values win over params.yaml's, so the local
# sources go into a profile of their own, made from h200 as a user would: the generated corpus, the
# built-in chat data (no hub), a tokenizer trained on 20M characters (h200's 2G would take the call).
# Device call: carry [".whl"], command `bash bench/gpu/data_h200.sh [SIZE]`.
SIZE=${1:-200MB}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD python3 -m bench.corpus --size "$SIZE" --out /tmp/corpus.jsonl 2>/dev/null || exit 1
PYTHONPATH=/tmp/site python3 - <<'PY' || exit 1
import yaml
p = yaml.safe_load(open("profiles/h200.yaml"))
p["data"].update(pretrain_sources=["/tmp/corpus.jsonl"], chat_sources=["builtin:synthetic"], synthetic_train=12000,
                 synthetic_eval=50)
p["tokenizer"]["train_chars"] = 20_000_000
p["pretrain"].update(steps=8, eval_tokens=1048576, log_every=1)
yaml.safe_dump(p, open("profiles/h200-generated.yaml", "w"), sort_keys=False)
PY
PROFILE=h200-generated DVC_TIMEOUT=${DVC_TIMEOUT:-300} bash bench/gpu/pipeline_h200_small_dvc.sh pretrain
