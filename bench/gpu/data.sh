#!/bin/bash
# The data path at GPU scale: does the memory-mapped loader keep the GPU fed at d20 under fp8? A corpus
# of SIZE generated here (bench/corpus.py, in PARTS files side by side), a profile made from `h200` as a
# user would make one (the generated corpus, every byte of it read; the built-in chat data, no hub; a
# tokenizer trained on 20M characters; pretrain capped at STEPS steps), `dvc exp run ... pretrain` from a
# fresh clone (bench/gpu/pipeline.sh), then the probe at the same shape on the token file pretrain read.
# Pretrain's sustained tokens/s and idle time (reports/timings/pretrain.json) against the probe's
# micro-step and whole step (probe/probe.json): PROBE_RUNS runs of the probe give its median and range.
#   bash bench/gpu/data.sh [SIZE]      (default 5GB; about 10 minutes on an H200 with 16 cores)
# Environment: STEPS (40), PROBE_STEPS (30), PROBE_RUNS (3), PARTS (8), OUT (/tmp/sparkchat-bench/data),
# SCRATCH (/tmp: the corpus, the clone). gpu.csv: nvidia-smi every 0.5 s throughout.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
SIZE=${1:-5GB} STEPS=${STEPS:-40} PARTS=${PARTS:-8} T=${SCRATCH:-/tmp}
OUT=$(realpath -m "${OUT:-/tmp/sparkchat-bench/data}")  # absolute: the script moves into the clone
CORPUS=$T/sparkchat-corpus
mkdir -p "$OUT" "$CORPUS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 500 > "$OUT/gpu.csv" &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT
part=$(python3 -c "from bench.corpus import parse_size; print(-(-parse_size('$SIZE') // $PARTS))") || exit 1
start=$(date +%s) pids=()
for i in $(seq 0 $((PARTS - 1))); do
  python3 -m bench.corpus --size "$part" --seed "$i" --out "$CORPUS/part_$i.jsonl" 2>/dev/null &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || exit 1; done
echo "corpus: $(du -cb "$CORPUS"/*.jsonl | tail -1 | cut -f1) bytes in $PARTS files, $(( $(date +%s) - start )) s" \
  | tee "$OUT/corpus.log"
# a profile's values win over params.yaml's, so the local sources go into a profile of their own
python3 - "$STEPS" "$PARTS" "$CORPUS" <<'PY' || exit 1
import sys, yaml
steps, parts, corpus = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
p = yaml.safe_load(open("profiles/h200.yaml"))
p["data"].update(pretrain_sources=[f"{corpus}/part_{i}.jsonl" for i in range(parts)], pretrain_tokens=10**10,
                 chat_sources=["builtin:synthetic"], synthetic_train=12000, synthetic_eval=50)
p["tokenizer"]["train_chars"] = 20_000_000
p["pretrain"].update(steps=steps, eval_tokens=1048576, log_every=1)
yaml.safe_dump(p, open("profiles/h200-generated.yaml", "w"), sort_keys=False)
PY
OUT=$OUT PROFILE=h200-generated bash bench/gpu/pipeline.sh pretrain || exit 1
rm -f profiles/h200-generated.yaml
# the probe: fp8 at the same shape (d20, 32 x 2048, the trained tokenizer's vocabulary) on the token file
cd "$T/sparkchat" || exit 1
vocab=$(python3 -c "from model.tokenizer import SparkTokenizer; from sparkchat import paths; print(SparkTokenizer.load(paths.TOKENIZER).vocab_size)")
tokens=$(python3 -c "from sparkchat import paths; print(paths.PRETRAIN_TRAIN_TOKENS)").ids.bin
batch=$(python3 -m bench.fit_batch --depth 20 --seq-len 2048 --vocab "$vocab" --batch 32) || exit 1  # halved to fit
python3 -m bench.probe_spread --runs "${PROBE_RUNS:-3}" --out "$OUT/probe" -- --depth 20 --seq-len 2048 --batch "$batch" \
  --vocab "$vocab" --backends fp8 --steps "${PROBE_STEPS:-30}" --tokens "$tokens" 2>&1 | tail -8
cp reports/timings/pretrain.json "$OUT/pretrain_timings.json"
