"""The design's import rules, checked on every project file (lazy imports inside functions too):
`model/` imports none of the wings; `pipeline/` and `serve/` never import each other; `bench/` uses
libraries (model/, the pipeline's shared modules, the server), never a stage's module."""
from __future__ import annotations

from pathlib import Path

from test_dvc import ROOT, imports_of, stage_module, stages

FORBIDDEN = {
    "model": ("pipeline", "serve", "sparkchat", "bench"),
    "pipeline": ("serve", "bench"),
    "serve": ("pipeline", "bench"),
}


def test_import_rules():
    broken = []
    for wing, banned in FORBIDDEN.items():
        for f in sorted((ROOT / wing).rglob("*.py")):
            for mod in imports_of(f):
                if mod.split(".")[0] in banned:
                    broken.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not broken, "\n".join(broken)


def test_bench_uses_no_stage():
    stage_modules = {stage_module(s) for f in ("dvc.yaml", "bench/dvc.yaml") for s in stages(f).values()}
    stage_modules |= {"pipeline.train"}  # the training stages' shared loop is a stage too
    for f in sorted((ROOT / "bench").rglob("*.py")):
        used = imports_of(f) & stage_modules
        assert not used, f"{f.relative_to(ROOT)} imports the stage module(s) {sorted(used)}"


def test_sparkchat_package_imports_no_wing_at_import_time():
    # the dispatcher may import the wings lazily (inside functions), never at module level
    import ast
    for f in sorted((ROOT / "sparkchat").rglob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for n in names:
                    assert n.split(".")[0] not in ("pipeline", "serve", "bench", "torch"), \
                        f"{f.relative_to(ROOT)} imports {n} at module level"
