"""params.yaml and every profile load against the code that reads them; bad values fail naming the key."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_params, params_from_dict
from project_files import committed_params, committed_text, run_on_params

ROOT = Path(__file__).resolve().parent.parent
PROFILES = sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml"))


def base() -> dict:
    """params.yaml as committed: an experiment's values in the workspace (`dvc exp run -S`) are not the defaults."""
    return committed_params(ROOT)


def test_default_params_load(tmp_path):
    (tmp_path / "params.yaml").write_text(committed_text(ROOT, "params.yaml"))
    (tmp_path / "profiles").symlink_to(ROOT / "profiles")
    p = load_params(tmp_path / "params.yaml")
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
    assert {"h200", "node8", "spark", "spark-pair"} <= set(PROFILES)


@pytest.mark.parametrize("edit, key", [
    (lambda d: d["pretrain"].update(matrix_lrr=0.1), "pretrain.matrix_lrr"),
    (lambda d: d.update(trainer={}), "trainer"),
    (lambda d: d["model"].update(depth="four"), "model.depth"),
    (lambda d: d["sft"].update(matrix_lr="fast"), "sft.matrix_lr"),
    (lambda d: d["model"].update(head_dim=48), "model.head_dim"),
    (lambda d: d["model"].update(kv_head_ratio=3), "model.kv_head_ratio"),
    (lambda d: d["precision"].update(backend="fp4"), "precision.backend"),
    (lambda d: d["precision"]["te_fp8"].update(recipe="magic"), "precision.te_fp8.recipe must be one of delayed"),
    (lambda d: d["precision"].update(te_recipe="delayed"), "unknown key 'precision.te_recipe'"),
    (lambda d: d["precision"]["fp8"].update(scaling="lazy"), "precision.fp8.scaling must be one of dynamic, delayed"),
    (lambda d: d["precision"]["fp8"].update(fastaccum="all"), "unknown key 'precision.fp8.fastaccum'"),
    (lambda d: d["precision"]["fp8"].update(pow2_scales="yes"), "precision.fp8.pow2_scales must be true or false"),
    (lambda d: d["precision"]["fp8"].update(amax_history_len=0), "precision.fp8.amax_history_len must be >= 1"),
    (lambda d: d["precision"]["nvfp4"].update(bf16_last_blocks=-1), "precision.nvfp4.bf16_last_blocks must be >= 0"),
    (lambda d: d["precision"]["layer_filter"].update(dim_multiple=0), "precision.layer_filter.dim_multiple"),
    (lambda d: d["precision"].update(auto=[]), "precision.auto must be a mapping"),
    (lambda d: d["probe"].update(backends=["bf16", "fp8:scaling=lazy"]),
     "probe.backends[1]: probe entry 'fp8:scaling=lazy': precision.fp8.scaling"),
    (lambda d: d["pretrain"].update(warmup_frac=0.8, warmdown_frac=0.5), "pretrain.warmup_frac"),
    (lambda d: d["data"].update(pretrain_sources="builtin:shakespeare"), "data.pretrain_sources"),
    (lambda d: d["runtime"].update(device="tpu"), "runtime.device"),
    (lambda d: d["runtime"].update(parallel="zero3"), "runtime.parallel must be one of ddp, fsdp"),
    (lambda d: d["runtime"].update(compile=True), "runtime.compile must be one of auto, on, off; got True"),
    (lambda d: d["sft"].update(backend="fp16"), 'sft.backend must be one of "", bf16, fp8'),
    (lambda d: d["pretrain"].update(epochs=0), "pretrain.epochs must be > 0"),
    (lambda d: d["tokenizer"].update(vocab_size=256), "tokenizer.vocab_size must be >= 300"),
    (lambda d: d["probe"].update(steps=0), "probe.steps must be >= 1"),
    (lambda d: d["probe"].update(te_recipes=["delayed", "fast"]), "probe.te_recipes[1] must be one of delayed"),
    (lambda d: d["runtime"].update(nnodes=0), "runtime.nnodes must be >= 1"),
    (lambda d: d["runtime"].update(nnodes=2, rdzv_endpoint="node0:29500", node_rank=2), "runtime.node_rank must be in 0..1"),
    (lambda d: d["runtime"].update(nnodes=2), "runtime.rdzv_endpoint must be host:port of node 0, e.g. spark-1:29500 (where the 2 machines"),
    (lambda d: d["runtime"].update(rdzv_endpoint="node0"), "runtime.rdzv_endpoint must be host:port"),
    (lambda d: d["runtime"].update(rdzv_endpoint="node0:99999"), "runtime.rdzv_endpoint must be host:port"),
    (lambda d: d["runtime"].update(timeout_s=0), "runtime.timeout_s must be >= 1"),
    (lambda d: d.update(profile="nope"), "profile 'nope'"),
    (lambda d: d["evaluate"]["benchmarks"]["mmlu"].update(source="data/mmlu.csv"),
     "evaluate.benchmarks.mmlu.source='data/mmlu.csv': a local source must be a .jsonl, .json, .parquet file"),
    (lambda d: d["evaluate"]["benchmarks"]["arc_easy"].update(source="nowhere/arc.jsonl"),
     "evaluate.benchmarks.arc_easy.source='nowhere/arc.jsonl': no such file"),
    (lambda d: d["evaluate"]["benchmarks"]["gsm8k"].update(source="hub:"), "evaluate.benchmarks.gsm8k.source='hub:'"),
    (lambda d: d["evaluate"]["benchmarks"]["hellaswag"].update(shots=-1), "evaluate.benchmarks.hellaswag.shots"),
    (lambda d: d["evaluate"]["benchmarks"].update(piqa={"source": ""}), "unknown key 'evaluate.benchmarks.piqa'"),
    (lambda d: d["evaluate"].update(extra=["mmlu:hub:cais/mmlu"]), "unknown key 'evaluate.extra'"),
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
    r = run_on_params(ROOT, tmp_path, d, "pipeline.pretrain")
    assert r.returncode != 0
    assert "pretrain.lr" in r.stderr
    assert not (tmp_path / "artifacts").exists()


def differences(got, want, key: str = "") -> list[str]:
    """Every key where two nested mappings differ, as 'key: got vs want'."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [d for k in sorted(set(got) | set(want), key=str)
                for d in differences(got.get(k, "<missing>"), want.get(k, "<missing>"), f"{key}.{k}" if key else k)]
    return [] if got == want else [f"{key}: params.yaml {got!r} vs code {want!r}"]


def test_params_yaml_holds_the_code_defaults():
    """params.yaml, every section and every key, is the config dataclasses' defaults (and the backends'
    option dataclasses' under `precision:`): what config.py documents is what runs, and neither drifts."""
    import dataclasses

    from pipeline.config import Params

    diffs = differences(base(), dataclasses.asdict(Params()))
    assert not diffs, f"{len(diffs)} differences between params.yaml as committed (git show HEAD:params.yaml; " \
                      f"an experiment's values in the workspace do not count) and the code:\n" + "\n".join(diffs)


def literal_keys(cls, key: str = "") -> dict[str, tuple]:
    """Every key of a settings class (nested ones included) whose type is a Literal -> its allowed values."""
    import dataclasses
    import typing

    from model.settings import Settings, choices

    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            sub = f"{key}.{name}" if key else name
            if isinstance(tp, type) and issubclass(tp, Settings):
                out |= literal_keys(tp, sub)
            elif typing.get_origin(tp) is typing.Literal:
                out[sub] = choices(tp)
    return out


def test_params_yaml_choice_comments_match_the_code():
    """A `# a | b | c` comment beside a key in params.yaml lists exactly the values the code allows (its
    Literal type), and every key with a fixed set of values has one (a stage's `backend` says what its
    empty value means instead), so the comments cannot drift either."""
    import re

    from pipeline.config import Params

    allowed = literal_keys(Params)
    path, seen = [], set()
    for line in committed_text(ROOT, "params.yaml").splitlines():
        m = re.match(r"( *)(\w+):([^#]*)(?:#\s*(.*))?$", line)
        if not m:
            continue
        indent, name, _, comment = m.groups()
        path = path[:len(indent) // 2] + [name]
        key = ".".join(path)
        if comment and " | " in comment:
            listed = tuple(part.split()[0] for part in comment.split(" | "))
            assert listed == allowed.get(key), f"params.yaml {key}: comment lists {listed}, code allows {allowed.get(key)}"
            seen.add(key)
    stage_backends = {f"{s}.backend" for s in ("pretrain", "midtrain", "sft", "rl")}
    assert seen == set(allowed) - stage_backends, f"keys without a choices comment: {set(allowed) - stage_backends - seen}"


def test_every_knob_has_a_docstring():
    """Each field of every settings class in config.py and options.py is followed by its docstring: the
    one place a knob is documented (the README sends readers there). A nested block is documented by its
    class's docstring; a field a subclass declares again to change its default, by its base class."""
    import ast
    import dataclasses
    import importlib
    import typing

    from model.settings import Settings

    missing = []
    for module in ("pipeline.config", "model.precision.options"):
        mod = importlib.import_module(module)
        tree = ast.parse(Path(mod.__file__).read_text())
        for node in tree.body:
            cls = getattr(mod, getattr(node, "name", ""), None)
            if not (isinstance(node, ast.ClassDef) and isinstance(cls, type) and issubclass(cls, Settings)):
                continue
            assert ast.get_docstring(node), f"{module}.{node.name} has no docstring"
            nested = {n for n, tp in typing.get_type_hints(cls).items() if isinstance(tp, type) and issubclass(tp, Settings)}
            inherited = {f for base in cls.__mro__[1:] if issubclass(base, Settings) and dataclasses.is_dataclass(base)
                         for f in base.__dataclass_fields__}
            for i, item in enumerate(node.body):
                if isinstance(item, ast.AnnAssign) and "ClassVar" not in ast.unparse(item.annotation) \
                        and item.target.id not in nested | inherited:
                    after = node.body[i + 1] if i + 1 < len(node.body) else None
                    if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
                        missing.append(f"{module}.{node.name}.{item.target.id}")
    assert not missing, f"knobs without a docstring: {missing}"


def test_precision_options_reach_the_backend():
    """The typed options a stage hands its backend are params.yaml's blocks (a profile overlay changes
    one field and keeps the rest); auto without a probe file reads the probe stage's output."""
    from model.precision.options import AutoOptions, Fp8Options, TEFp8Options
    from sparkchat import paths

    d = base()
    d["precision"]["fp8"]["scaling"] = "delayed"
    d["precision"]["te_fp8"]["recipe"] = "current"
    pr = params_from_dict(d, ROOT / "profiles").precision
    assert pr.options_for("fp8") == Fp8Options(scaling="delayed")
    assert pr.options_for("te-fp8") == TEFp8Options(recipe="current")
    assert pr.options_for("bf16") is None and pr.options_for("fp8-emulated") is None
    assert pr.options_for("nvfp4-emulated") is pr.options_for("te-nvfp4") is pr.nvfp4
    assert pr.options_for("auto") == AutoOptions(probe_file=str(paths.PROBE / "probe.json"))
    d["profile"] = "h200"
    overlaid = params_from_dict(d, ROOT / "profiles").precision  # h200 sets precision.backend only
    assert overlaid.backend == "fp8" and overlaid.options_for("fp8") == Fp8Options(scaling="delayed")


def test_config_and_probe_help_load_without_torch():
    """The configuration and `sparkchat probe --help` need no torch (it loads in seconds)."""
    code = ("import sys; import pipeline.config, pipeline.probe; pipeline.probe.parser().format_help(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_probe_flag_has_help_with_its_default():
    from model.precision.options import ProbeOptions
    from pipeline.probe import parser

    actions = [a for a in parser()._actions if a.dest != "help"]
    for a in actions:
        assert a.help and "(default: " in a.help, a.option_strings
    steps = next(a for a in actions if a.dest == "steps")
    assert f"(default: {ProbeOptions().steps})" in steps.help


def test_params_yaml_is_in_the_form_dvc_writes():
    """`dvc exp run -S key=value` rewrites params.yaml through DVC's YAML round trip: in that form already,
    an experiment's diff is the line of the value it sets, not a restyling of the file."""
    import tempfile

    from dvc.utils.hydra import apply_overrides

    from pipeline.config import Params

    lr = Params().sft.matrix_lr
    text = committed_text(ROOT, "params.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(text)
        apply_overrides(str(path), [f"sft.matrix_lr={lr}"])  # the value it holds: DVC's rewrite alone
        assert path.read_text() == text, "params.yaml is not in the form DVC's -S writes: rewrite it with " \
            "dvc.utils.hydra.apply_overrides (a value it holds) until it stops changing"
        apply_overrides(str(path), [f"sft.matrix_lr={lr * 2}"])
        old, new = text.splitlines(), path.read_text().splitlines()
    assert len(old) == len(new) and [(a, b) for a, b in zip(old, new) if a != b] == \
        [(f"  matrix_lr: {lr}", f"  matrix_lr: {lr * 2}")]
