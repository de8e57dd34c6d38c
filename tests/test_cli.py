"""The `sparkchat` command line: chat in a terminal over a real (tiny, random) model directory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_chat_command_answers_and_exits(serve_model_dir):
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "chat", "--model", str(serve_model_dir),
                        "--max-tokens", "5", "--temperature", "0"],
                       input="Hello there\nWhat is 2 + 2?\n", capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "type a message" in r.stderr
    assert r.stdout.count("> ") >= 2  # a prompt per turn, plus a reply after each


def test_unknown_command_is_an_error():
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "trian"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "unknown command 'trian'" in r.stderr
