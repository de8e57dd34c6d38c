"""After `make repro`: which git-tracked results differ from the committed run, and what to do about it.

The committed `dvc.lock` and `reports/` record the run the project published. A fresh clone's run on
another machine gives the same files when its CPU sums floats in the same order (pipeline/__init__.py
pins MKL's and ATen's kernels on x86 for that); a machine that still rounds differently gets other model
bytes in the last bits, and with them other hashes and metrics. This says which files changed, which
stages' outputs moved, and how to take the run as your own baseline or return to the published one.
"""
from __future__ import annotations

import subprocess
import sys

import yaml

TRACKED = ["dvc.lock", "reports"]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def moved_stages(old_lock: str, new_lock: str) -> list[str]:
    """Stages whose outputs' hashes differ between two dvc.lock texts."""
    def outs(text: str) -> dict:
        stages = (yaml.safe_load(text) or {}).get("stages", {})
        return {name: {o["path"]: o.get("md5") for o in s.get("outs", [])} for name, s in stages.items()}
    old, new = outs(old_lock), outs(new_lock)
    return [name for name in new if name in old and old[name] != new[name]]


def main() -> int:
    try:
        changed = git("status", "--porcelain", "--", *TRACKED).splitlines()
    except (OSError, subprocess.CalledProcessError):
        return 0  # not a git clone: nothing to compare with
    if not changed:
        print("make repro: dvc.lock and reports/ equal the committed run")
        return 0
    print("make repro: these tracked files differ from the committed run:")
    print("".join(f"  {line}\n" for line in changed), end="")
    try:
        moved = moved_stages(git("show", "HEAD:dvc.lock"), open("dvc.lock").read())
    except (OSError, subprocess.CalledProcessError):
        moved = []
    if moved:
        print(f"Outputs with other bytes: {', '.join(moved)}. The inputs are the committed ones; the model bytes "
              "then differ because this machine's CPU rounds sums differently (its kernels, thread count or "
              "instruction set), which changes the last bits of the weights and the metrics after them.")
    print("To take this run as your baseline: git commit dvc.lock reports -m 'my baseline'.\n"
          "To return to the published files: git checkout -- dvc.lock reports (then dvc status lists the "
          "stages above as changed, and dvc repro runs them again).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
