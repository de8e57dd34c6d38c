"""params.yaml and every profile load against the code that reads them; bad values fail naming the key."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, load_params, params_from_dict

ROOT = Path(__file__).resolve().parent.parent
PROFILES = sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml"))


def base() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_default_params_load():
    p = load_params(ROOT / "params.yaml")
    assert p.model.n_embd == p.model.depth * p.model.aspect_ratio
    assert p.model.n_embd % p.model.n_head == 0


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_loads_and_validates(profile):
    d = base()
    d["profile"] = profile
    p = params_from_dict(d, ROOT / "profiles")
    assert p.profile == profile
    # the depth dial sets the width and heads
    assert p.model.n_head * p.model.head_dim == p.model.n_embd


def test_profiles_exist():
    assert {"h200", "node8", "spark"} <= set(PROFILES)


@pytest.mark.parametrize("edit, key", [
    (lambda d: d["pretrain"].update(matrix_lrr=0.1), "pretrain.matrix_lrr"),
    (lambda d: d.update(trainer={}), "trainer"),
    (lambda d: d["model"].update(depth="four"), "model.depth"),
    (lambda d: d["sft"].update(matrix_lr="fast"), "sft.matrix_lr"),
    (lambda d: d["model"].update(head_dim=48), "model.head_dim"),
    (lambda d: d["model"].update(kv_head_ratio=3), "model.kv_head_ratio"),
    (lambda d: d["precision"].update(backend="fp4"), "precision.backend"),
    (lambda d: d["precision"].update(te_recipe="magic"), "precision.te_recipe"),
    (lambda d: d["pretrain"].update(warmup_frac=0.8, warmdown_frac=0.5), "pretrain.warmup_frac"),
    (lambda d: d["data"].update(pretrain_sources="builtin:shakespeare"), "data.pretrain_sources"),
    (lambda d: d["runtime"].update(device="tpu"), "runtime.device"),
    (lambda d: d.update(profile="nope"), "profile 'nope'"),
])
def test_bad_values_name_the_key(edit, key):
    d = base()
    edit(d)
    with pytest.raises(ConfigError) as e:
        params_from_dict(d, ROOT / "profiles")
    assert key in str(e.value)


def test_bad_params_fail_fast_and_write_nothing(tmp_path):
    """A stage run on a bad params.yaml exits quickly with the key in the message and no outputs."""
    d = base()
    d["pretrain"]["lr"] = 0.1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    (tmp_path / "profiles").symlink_to(ROOT / "profiles")
    r = subprocess.run([sys.executable, "-m", "pipeline.pretrain"], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0
    assert "pretrain.lr" in r.stderr
    assert not (tmp_path / "artifacts").exists()
