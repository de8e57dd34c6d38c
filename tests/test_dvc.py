"""dvc.yaml is true by construction: each stage's code deps are exactly its import closure, its
outputs are the paths `sparkchat.paths` gives, and it reads only the params sections it declares.

The import closure is computed from the code (every `import` statement, at module level or inside a
function, of the project's own packages), so a new import that dvc.yaml does not list fails here.
"""
from __future__ import annotations

import ast
from pathlib import Path

import yaml

from pipeline.config import STAGE_SECTIONS
from sparkchat import paths

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "pipeline", "serve", "sparkchat", "bench")


def module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _import_nodes(tree: ast.Module, skip_lazy: bool):
    """Every import statement; with skip_lazy, not those in a module-level __getattr__ (PEP 562 lazy
    exports, which run only when a name they serve is asked for: see lazy_exports)."""
    skip = set()
    if skip_lazy:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                skip |= {id(n) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def lazy_exports(package: str) -> tuple[set[str], set[str]]:
    """(names the package defines at module level, modules its __getattr__ imports) of a package whose
    __init__ has a module-level __getattr__; (all names, no modules) otherwise."""
    path = module_file(package)
    tree = ast.parse(path.read_text())
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return set(), set()
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    lazy = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            lazy = imports_of(path, only=node)
    return defined, lazy


def imports_of(path: Path, only: ast.AST | None = None) -> set[str]:
    """Project modules `path` imports (absolute names), including the packages on the way. A name
    taken from a package that serves it lazily (module-level __getattr__) brings what serving it imports."""
    package = ".".join(path.relative_to(ROOT).parent.parts)  # what a relative import starts from
    found = set()
    nodes = [n for n in ast.walk(only) if isinstance(n, (ast.Import, ast.ImportFrom))] if only is not None \
        else _import_nodes(ast.parse(path.read_text()), skip_lazy=path.name == "__init__.py")
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
            if only is None and base.split(".")[0] in PACKAGES and module_file(base) \
                    and module_file(base).name == "__init__.py":
                defined, lazy = lazy_exports(base)
                if lazy and any(a.name not in defined and not module_file(f"{base}.{a.name}") for a in node.names):
                    found |= lazy
        for name in names:
            if name.split(".")[0] not in PACKAGES:
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
                if module_file(".".join(parts[:i])):
                    found.add(".".join(parts[:i]))
    return found


def import_closure(module: str) -> set[Path]:
    """Files of every project module that running `python -m module` may import."""
    todo, seen = [module], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(imports_of(module_file(name)))
    return {module_file(n).relative_to(ROOT) for n in seen}


def raw_stages(dvc_file: str = "dvc.yaml") -> dict:
    """The stages as written: a `foreach` stage is one entry whose `do` holds the template."""
    return yaml.safe_load((ROOT / dvc_file).read_text())["stages"]


def stages(dvc_file: str = "dvc.yaml") -> dict:
    """Every stage by the name DVC gives it: a `foreach` over a mapping becomes one stage per key
    (`name@key`), with ${key} and ${item} filled in as DVC fills them."""
    out = {}
    for name, stage in raw_stages(dvc_file).items():
        if "foreach" not in stage:
            out[name] = stage
            continue
        for key, item in stage["foreach"].items():
            text = yaml.safe_dump(stage["do"]).replace("${key}", key).replace("${item}", str(item))
            out[f"{name}@{key}"] = yaml.safe_load(text)
    return out


def instances(st: dict, name: str) -> list[dict]:
    """The stage `name`, or each stage a `foreach` named `name` expands to."""
    return [s for n, s in st.items() if n == name or n.startswith(f"{name}@")]


def stage_module(stage: dict) -> str:
    return stage["cmd"].split("python -m ", 1)[1].split()[0]


def code_deps(stage: dict) -> set[Path]:
    """The stage's deps that are code (files or folders under the project's packages), expanded."""
    out = set()
    for d in stage.get("deps", []):
        p = Path(d)
        if p.parts[0] not in PACKAGES:
            continue
        out |= {f.relative_to(ROOT) for f in (ROOT / p).rglob("*.py")} if (ROOT / p).is_dir() else {p}
    return out


def closure_mismatch(stage: dict) -> tuple[set[Path], set[Path]]:
    """(imported but not listed, listed but not imported)."""
    need, have = import_closure(stage_module(stage)), code_deps(stage)
    return need - have, have - need


def test_every_stage_lists_exactly_its_import_closure():
    for dvc_file in ("dvc.yaml",):
        for name, stage in stages(dvc_file).items():
            missing, extra = closure_mismatch(stage)
            assert not missing, f"{dvc_file} stage '{name}' imports {sorted(map(str, missing))} but does not list them in deps"
            assert not extra, f"{dvc_file} stage '{name}' lists {sorted(map(str, extra))} in deps but never imports them"


def test_the_check_catches_a_removed_dep():
    stage = dict(stages()["pretrain"])
    stage["deps"] = [d for d in stage["deps"] if d != "model/gpt.py"]
    missing, _ = closure_mismatch(stage)
    assert Path("model/gpt.py") in missing


def test_stages_depend_on_their_resolved_params():
    st = stages()
    outs = {str(paths.stage_params(s)) for s in STAGE_SECTIONS}
    assert set(st["params"]["outs"]) == outs
    for name in STAGE_SECTIONS:
        assert instances(st, name), f"no stage '{name}' in dvc.yaml"
        for stage in instances(st, name):
            assert str(paths.stage_params(name)) in stage["deps"], f"stage '{name}' must depend on its params file"
            assert "params" not in stage, f"stage '{name}' reads its params through {paths.stage_params(name)}"
    assert set(st["params"]["params"]) >= {"profile", *(s for ss in STAGE_SECTIONS.values() for s in ss)}
    assert "profiles" in st["params"]["deps"]


def _declared(stage: dict, key: str) -> set[str]:
    out = set()
    for item in stage.get(key, []):
        out |= set(item) if isinstance(item, dict) else {item}
    return out


def test_outputs_are_where_paths_says():
    st = stages()
    for name in paths.TRAIN_STAGES:
        outs = _declared(st[name], "outs")
        assert {str(paths.MODEL_DIRS[name]), str(paths.checkpoint_dir(name))} <= outs, name
        assert _declared(st[name], "plots") == {str(paths.plot_file(name)), str(paths.val_file(name))}
    for name in paths.TRAIN_STAGES:  # headline metrics: what dvc metrics show lists
        assert _declared(st[name], "metrics") == {str(paths.metrics_file(name))}, name
    # evaluate: one stage per model, scoring that model, with its own reports
    assert raw_stages()["evaluate"]["foreach"] == {m: str(p) for m, p in paths.EVAL_MODELS.items()}
    assert len(instances(st, "evaluate")) == len(paths.EVAL_MODELS)
    chart = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"][0]
    for model, model_dir in paths.EVAL_MODELS.items():
        stage, reports = st[f"evaluate@{model}"], paths.eval_reports(model)
        assert str(model_dir) in stage["deps"] and stage["cmd"].endswith(f" {model}")
        assert _declared(stage, "metrics") == {str(paths.metrics_file(reports))}
        assert _declared(stage, "outs") == {str(paths.details_file(reports)), str(paths.plot_file(reports))}
        assert str(paths.plot_file(reports)) in next(iter(chart.values()))["y"]
    for name in ("prepare", "tokenizer", "tokenize", *paths.TRAIN_STAGES):  # the rest of what the inputs decide
        assert str(paths.details_file(name)) in _declared(st[name], "outs"), name
    assert {str(p) for p in (paths.PRETRAIN_SHARDS, paths.MID_TRAIN, paths.SFT_TRAIN, paths.CHAT_VAL,
                             paths.EVAL_ITEMS, paths.details_file("prepare"))} == _declared(st["prepare"], "outs")
    assert str(paths.TOKENIZER) in _declared(st["tokenizer"], "outs")
    assert {str(paths.PRETRAIN_TOKENS), str(paths.CHAT_TOKENS), str(paths.details_file("tokenize"))} \
        == _declared(st["tokenize"], "outs")
    # timings are declared nowhere (no hash in dvc.lock) and git ignores them
    declared = {f for stage in st.values() for key in ("outs", "metrics", "plots") for f in _declared(stage, key)}
    assert not {f for f in declared if f.startswith(str(paths.TIMINGS))}
    assert f"/{paths.TIMINGS}/" in (ROOT / ".gitignore").read_text().splitlines()
    assert _declared(st["export"], "outs") == {str(paths.HF_EXPORT)}


def test_export_depends_on_what_its_card_quotes():
    from pipeline.export import PARAM_STAGES
    deps = set(stages()["export"]["deps"])
    evals = [paths.eval_reports(m) for m in paths.EVAL_MODELS]
    quoted = {paths.CHAT_MODEL, *(paths.metrics_file(s) for s in (*paths.TRAIN_STAGES, *evals)),
              *(paths.details_file(s) for s in (*paths.TRAIN_STAGES, *evals)),
              *(paths.stage_params(s) for s in PARAM_STAGES)}
    assert {str(p) for p in quoted} <= deps


def compact(files: set[Path]) -> list[str]:
    """Files as dvc.yaml lists them: a folder whose every .py file is in the set stands for them."""
    out, files = [], set(files)
    for folder in sorted({f.parent for f in files}, key=lambda d: len(d.parts)):
        if len(folder.parts) > 1 and all(f.relative_to(ROOT) in files for f in (ROOT / folder).rglob("*.py")):
            inside = {f for f in files if folder in f.parents}
            if inside:
                out.append(str(folder))
                files -= inside
    return sorted(out + [str(f) for f in files])


def write_code_deps(dvc_file: str) -> None:
    """Rewrite each stage's `deps:` list in `dvc_file`: its import closure, then its other deps."""
    import textwrap
    lines = (ROOT / dvc_file).read_text().split("\n")
    for name, stage in raw_stages(dvc_file).items():
        stage = stage.get("do", stage)  # a foreach stage: its template
        other = [f'"{d}"' if "{" in d else d for d in stage["deps"] if Path(d).parts[0] not in PACKAGES]  # ${item}
        i = next(k for k, line in enumerate(lines) if line.split("#")[0].rstrip() == f"  {name}:")
        j = next(k for k in range(i, len(lines)) if lines[k].lstrip().startswith("deps: ["))
        k = next(k for k in range(j, len(lines)) if lines[k].rstrip().endswith("]"))
        indent = " " * (len(lines[j]) - len(lines[j].lstrip()))
        body = indent + "deps: [" + ", ".join(compact(import_closure(stage_module(stage))) + other) + "]"
        lines[j:k + 1] = textwrap.wrap(body, width=118, subsequent_indent=indent + " " * 7, break_on_hyphens=False)
    (ROOT / dvc_file).write_text("\n".join(lines))


if __name__ == "__main__":  # python tests/test_dvc.py [--write]: print (or write) each stage's code deps
    import sys
    for dvc_file in ("dvc.yaml",):
        if "--write" in sys.argv:
            write_code_deps(dvc_file)
        for name, stage in stages(dvc_file).items():
            print(f"{dvc_file} {name}: [{', '.join(compact(import_closure(stage_module(stage))))}]")
