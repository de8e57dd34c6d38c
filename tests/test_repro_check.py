"""make repro's closing check: it names the tracked results that differ from the committed run and the
stages whose outputs moved, and says nothing is wrong when they are equal."""
from __future__ import annotations

import subprocess

from sparkchat import repro_check

LOCK = "schema: '2.0'\nstages:\n  sft:\n    outs:\n    - path: artifacts/model\n      md5: {}\n" \
       "  tokenizer:\n    outs:\n    - path: artifacts/tokenizer/tokenizer.json\n      md5: aaa\n"


def test_it_names_what_moved_and_how_to_adopt_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = lambda *a: subprocess.run(["git", *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "dvc.lock").write_text(LOCK.format("111"))
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "m.json").write_text('{"loss": 1.0}\n')
    run("add", ".")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "published")
    assert repro_check.main() == 0
    assert "equal the committed run" in capsys.readouterr().out

    (tmp_path / "dvc.lock").write_text(LOCK.format("222"))
    (tmp_path / "reports" / "m.json").write_text('{"loss": 1.1}\n')
    repro_check.main()
    out = capsys.readouterr().out
    assert "dvc.lock" in out and "reports/m.json" in out
    assert "Outputs with other bytes: sft." in out and "tokenizer" not in out.split("Outputs")[1].split(".")[0]
    assert "git commit dvc.lock reports" in out and "git checkout -- dvc.lock reports" in out
