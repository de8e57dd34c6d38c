"""The design's import rules, checked on every project file (lazy imports inside functions too):
`model/` imports none of the wings; `pipeline/` and `serve/` never import each other. (`bench/` may
import a stage's core function to time that stage; the probe's library lives in model/precision/.)"""
from __future__ import annotations


from test_dvc import ROOT, imports_of

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


def test_a_front_end_loads_no_torch_and_no_engine_process():
    """A front end (the API, the chat page) talks to the engine through serve.wire only: importing it
    loads neither torch nor the engine process's module (fails when a front-end module imports either,
    directly or through model/)."""
    import subprocess
    import sys
    code = ("import sys, serve.api, serve.ui, serve.supervisor; "
            "print(sorted(m for m in ('torch', 'serve.engine_proc', 'model.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
