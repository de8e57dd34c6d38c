"""Where every artifact lives: the one map of the pipeline's files. The stages, the server's defaults,
the benchmarks and the tests read paths from here; `dvc.yaml` declares the same paths as outputs, and
`tests/test_dvc.py` checks that the two agree.

Paths are relative to the project root, where DVC runs every stage.
  artifacts/  big outputs, git-ignored and kept in DVC's cache (data, tokenizer, models, checkpoints)
  reports/    small metrics and plot files that git keeps, so `dvc exp show`, `dvc metrics diff` and
              `dvc plots diff` can compare main with every experiment: only what a stage's inputs decide
              (its timings go to reports/timings/, which git ignores)
"""
from __future__ import annotations

from pathlib import Path

ARTIFACTS = Path("artifacts")
REPORTS = Path("reports")

DATA = ARTIFACTS / "data"
# prepare's pretraining text: parquet shards train_00000.parquet ..., val_00000.parquet ... and an
# index.json written last (shards, documents, characters)
PRETRAIN_SHARDS = DATA / "pretrain"
MID_TRAIN = DATA / "mid_train.parquet"
SFT_TRAIN = DATA / "sft_train.parquet"
CHAT_VAL = DATA / "chat_val.parquet"
EVAL_ITEMS = DATA / "eval"

TOKENIZER = ARTIFACTS / "tokenizer" / "tokenizer.json"

# the tokenize stage's flat token files, read by memory map. A split is named by a path prefix:
# <prefix>.ids.bin (+ .mask.bin and .offsets.bin for conversations), described by the index.json
# beside it, which is written last: token files without a matching index are refused.
TOKENS = ARTIFACTS / "tokens"
PRETRAIN_TOKENS = TOKENS / "pretrain"
CHAT_TOKENS = TOKENS / "chat"
PRETRAIN_TRAIN_TOKENS = PRETRAIN_TOKENS / "train"
PRETRAIN_VAL_TOKENS = PRETRAIN_TOKENS / "val"
MID_TRAIN_TOKENS = CHAT_TOKENS / "mid_train"
SFT_TRAIN_TOKENS = CHAT_TOKENS / "sft_train"
CHAT_VAL_TOKENS = CHAT_TOKENS / "chat_val"

TRAIN_STAGES = ("pretrain", "midtrain", "sft")  # the stages pipeline/train.py runs on token files
# the model directory each training stage writes. The last, rl's, is the chat model everything serves and exports
# (with `rl.enabled: false`, SFT's model copied unchanged)
MODEL_DIRS = {"pretrain": ARTIFACTS / "pretrain" / "model", "midtrain": ARTIFACTS / "midtrain" / "model",
              "sft": ARTIFACTS / "sft" / "model", "rl": ARTIFACTS / "model"}
CHAT_MODEL = MODEL_DIRS["rl"]
# the models the evaluate stage scores, one DVC stage each (dvc.yaml: evaluate@<name>), so a changed model
# re-scores only itself; each writes its reports under eval_reports(name)
EVAL_MODELS = {"base": MODEL_DIRS["pretrain"], "midtrain": MODEL_DIRS["midtrain"], "sft": MODEL_DIRS["sft"],
               "rl": MODEL_DIRS["rl"]}


def eval_reports(model: str) -> str:
    """The report folder of one model's evaluation, as a stage name for metrics_file and friends."""
    return f"evaluate/{model}"

# the chat model as a Hugging Face transformers NanoChat directory, with a model card (stage `export`)
HF_EXPORT = ARTIFACTS / "hf"

PROBE = ARTIFACTS / "probe"


def stage_params(stage: str) -> Path:
    """The params one stage reads, resolved with the profile (written by the `params` stage)."""
    return ARTIFACTS / "params" / f"{stage}.json"


def checkpoint_dir(stage: str) -> Path:
    """Training checkpoints of one stage (kept across runs so a killed stage resumes)."""
    return ARTIFACTS / "ckpt" / stage


def token_index(split: Path) -> Path:
    """The index describing a token split (and the other splits in its folder)."""
    return split.parent / "index.json"


def metrics_file(stage: str) -> Path:
    """A stage's headline metrics: what `dvc metrics show` and `dvc exp show` list by default."""
    return REPORTS / stage / "metrics.json"


def details_file(stage: str) -> Path:
    """The rest of what a stage's inputs decide (counts, the backend, the device): a DVC output git keeps, not
    a declared metric, so the default table stays narrow; `dvc metrics show <file>` shows it."""
    return REPORTS / stage / "details.json"


# Timings and throughput (tokens/s, MB/s, MFU, idle time): the same inputs give other numbers on every run and
# machine, so they are neither declared in dvc.yaml (no hash in dvc.lock) nor kept by git (.gitignore);
# `dvc metrics show -R reports/timings` shows the last run of each stage in this workspace
TIMINGS = REPORTS / "timings"


def timings_file(stage: str) -> Path:
    return TIMINGS / f"{stage}.json"


def throughput_file(stage: str) -> Path:
    """A training stage's tokens/s on each logged step of its last run, a plot (`dvc plots show` on it:
    docs/pipeline.md, "Outputs")."""
    return TIMINGS / f"{stage}.tsv"


def plot_file(stage: str) -> Path:
    """A training stage's loss curve, rl's reward curve, or one evaluation's scores per task (eval_reports)."""
    if stage.startswith("evaluate/"):
        return REPORTS / stage / "scores.tsv"
    return REPORTS / stage / ("reward.tsv" if stage == "rl" else "loss.tsv")


def val_file(stage: str) -> Path:
    """A training stage's validation bits per byte at each evaluation (a plot: lower is better)."""
    return REPORTS / stage / "val.tsv"


# rl's pass@1 and pass@k on held-out items of each task it trains on, before, during and after training (a plot)
RL_HELDOUT = REPORTS / "rl" / "heldout.tsv"
