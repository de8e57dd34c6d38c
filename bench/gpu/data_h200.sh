#!/bin/bash
# H200: the data path under the `h200` profile, through DVC on a fresh clone (pipeline_h200_small_dvc.sh),
# on a corpus generated there (bench/corpus.py), up to pretrain, steps capped: does the memory-mapped
# loader keep the GPU fed at d20 under fp8? Pretrain's sustained tokens/s and GPU idle time (its metrics)
# against the probe at the same shape on the same token file, in the same run.
#
# A profile's values win over params.yaml's, so the local sources go into a profile of their own, made
# from h200 as a user would: the generated corpus (in parts, generated in parallel), every byte of it
# read (data.pretrain_tokens above what it holds), the built-in chat data (no hub), a tokenizer trained
# on 20M characters (h200's 2G would take the call), pretrain capped at STEPS steps.
#
# The whole run outlasts one 10-minute device call, so it runs in a session of its own and two calls
# back to back (the machine stays warm 30 s between them) start it and collect it:
#   call 1: carry [".whl"], `bash bench/gpu/data_h200.sh start 5.2GB`  (starts it, follows it up to WAIT s)
#   call 2: carry [".whl"], `bash bench/gpu/data_h200.sh wait`         (follows it to the end, copies results)
# or, with fewer steps so that it fits one call (a missed second call loses the whole run):
#   carry [".whl"], `STEPS=12 PROBE_STEPS=20 bash bench/gpu/data_h200.sh once 5.05GB` (LIMIT s, 560)
# Comes back under $OUT: log, summary.txt, results.tar (from pipeline_h200_small_dvc.sh), gpu.csv
# (nvidia-smi every 0.5 s), corpus.log, probe/probe.json and probe.md.
MODE=${1:-start} SIZE=${2:-5.2GB} STEPS=${STEPS:-40} PARTS=${PARTS:-8} WAIT=${WAIT:-570}
T=/tmp/h200data RESULTS=/tmp/h200data/out
SRC=$PWD

run() {
  set -o pipefail
  mkdir -p $RESULTS /tmp/corpus
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$SRC PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 500 > $RESULTS/gpu.csv &
  smi=$!
  # the corpus in PARTS files generated side by side, seeds 0..PARTS-1
  part=$(python3 -c "from bench.corpus import parse_size; print(-(-parse_size('$SIZE') // $PARTS))")
  start=$(date +%s) pids=()
  for i in $(seq 0 $((PARTS - 1))); do
    python3 -m bench.corpus --size $part --seed $i --out /tmp/corpus/part_$i.jsonl 2>/dev/null &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait $pid || exit 1; done
  echo "corpus: $(du -cb /tmp/corpus/*.jsonl | tail -1 | cut -f1) bytes in $PARTS files, $(( $(date +%s) - start )) s" \
    | tee $RESULTS/corpus.log
  python3 - "$STEPS" "$PARTS" <<'PY' || exit 1
import sys, yaml
steps, parts = int(sys.argv[1]), int(sys.argv[2])
p = yaml.safe_load(open("profiles/h200.yaml"))
p["data"].update(pretrain_sources=[f"/tmp/corpus/part_{i}.jsonl" for i in range(parts)], pretrain_tokens=10**10,
                 chat_sources=["builtin:synthetic"], synthetic_train=12000, synthetic_eval=50)
p["tokenizer"]["train_chars"] = 20_000_000
p["pretrain"].update(steps=steps, eval_tokens=1048576, log_every=1)
yaml.safe_dump(p, open("profiles/h200-generated.yaml", "w"), sort_keys=False)
PY
  OUT=$RESULTS PROFILE=h200-generated DVC_TIMEOUT=1500 bash bench/gpu/pipeline_h200_small_dvc.sh pretrain
  # the probe: fp8 at the same shape (d20, 32 x 2048, the trained tokenizer's vocabulary), on the
  # pretraining token file itself
  cd /tmp/sparkchat || exit 1
  vocab=$(python3 -c "from model.tokenizer import SparkTokenizer; from sparkchat import paths; print(SparkTokenizer.load(paths.TOKENIZER).vocab_size)")
  tokens=$(python3 -c "from sparkchat import paths; print(paths.PRETRAIN_TRAIN_TOKENS)").ids.bin
  python3 -m pipeline.probe --depth 20 --seq-len 2048 --batch 32 --vocab $vocab --backends fp8 --steps ${PROBE_STEPS:-30} \
    --tokens $tokens --out $RESULTS/probe 2>&1 | tail -8
  kill $smi 2>/dev/null
}

follow() {
  until [ -e $T/done ] || [ $SECONDS -ge $WAIT ]; do
    sleep 15
    echo "[$(date +%T)] $(tail -c 2000 $T/run.log | tr '\r' '\n' | grep -v '^\s*$' | tail -1 | cut -c1-200)"
  done
  if [ -e $T/done ]; then
    tail -40 $T/run.log
    cp -r $RESULTS/. "$OUT"/ && cp $T/run.log "$OUT"/run.log
    echo "rc $(cat $T/done)"
  else
    echo "still running: follow it with 'bash bench/gpu/data_h200.sh wait' within 30 s"
  fi
}

export T RESULTS SRC SIZE STEPS PARTS PROBE_STEPS
if [ "$MODE" = start ]; then
  rm -rf $T && mkdir -p $T
  # its own session: it outlives this call (the device tool ends a call's other processes)
  setsid bash -c "cd '$SRC' && { $(declare -f run); run; echo \$? > $T/done; }" > $T/run.log 2>&1 < /dev/null &
  follow
elif [ "$MODE" = once ]; then
  rm -rf $T && mkdir -p $T
  export -f run
  timeout ${LIMIT:-560} bash -c run > $T/run.log 2>&1 < /dev/null
  echo "rc $?"; tail -40 $T/run.log
  cp -r $RESULTS/. "$OUT"/ 2>/dev/null; cp $T/run.log "$OUT"/run.log
elif [ "$MODE" = wait ]; then
  # a machine given back between the calls is a fresh one: nothing to follow, so say so at once
  [ -e $T/run.log ] || { echo "no run here to follow (the machine was given back): start it again"; exit 1; }
  follow
else
  echo "usage: data_h200.sh start|once [SIZE] | wait"; exit 2
fi
