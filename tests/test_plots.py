"""`dvc plots show` works offline: the page `make install` generates carries Vega inline, and the
project's own plot definitions (dvc.yaml, .dvc/plots/) render into a page with no external script.

The browser test renders that page in Debian's headless chromium with every host unreachable and
counts the drawn charts and bars; it skips itself when chromium is missing and saves a screenshot
under test-artifacts/.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkchat import paths, plots_template

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
SCRIPT_SRC = re.compile(r"<script\b[^>]*\bsrc\s*=", re.I)
LINK_HREF = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?https?:", re.I)
# what pipeline/evaluate.py main() writes, one file per model: one row per task; a benchmark scored only by
# log-likelihood (lambada) or only by generation (gsm8k) has no bar for the other models
SCORES = {"base": {"arithmetic": 0.05, "word_problem": 0.0, "largest": 0.27, "arc_easy": 0.31, "lambada": 0.02},
          "midtrain": {"arithmetic": 0.4, "word_problem": 0.12, "largest": 0.41, "arc_easy": 0.33, "lambada": 0.01},
          "sft": {"arithmetic": 0.55, "word_problem": 0.2, "largest": 0.52, "arc_easy": 0.36, "gsm8k": 0.03}}


def installed_page() -> Path:
    path = plots_template.template_path(ROOT)
    assert path.is_file(), f"{path} is missing: `make install` (python -m sparkchat.plots_template) writes it"
    return path


def test_installed_page_carries_vega_inline():
    html = installed_page().read_text(encoding="utf-8")
    assert not SCRIPT_SRC.search(html), "the page loads a script from elsewhere"
    assert not LINK_HREF.search(html)
    assert "{plot_divs}" in html
    assert "{scripts}" not in html, "DVC would put its CDN script tags there"
    for name in ("window.vega=", "window.vegaLite=", "window.vegaEmbed="):
        assert name in html, f"the inline bundle does not define {name.rstrip('=')}"


def test_installed_page_bundles_the_vega_lite_major_dvc_writes():
    # the page names the versions it was generated with, in the comment above the bundle
    libraries = re.search(r"Vega-Lite (\d+)\.\d+", installed_page().read_text(encoding="utf-8"))
    assert libraries, "the page does not say which Vega-Lite it carries"
    assert f"v{libraries.group(1)}" == plots_template.dvc_vegalite_major()


@pytest.fixture(scope="module")
def plots_page(tmp_path_factory) -> Path:
    """`dvc plots show` in a fresh DVC project holding this project's dvc.yaml, .dvc/config and
    .dvc/plots/ (templates and the installed page), with loss curves and eval scores in reports/."""
    installed_page()
    project = tmp_path_factory.mktemp("dvcproject")
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=project, check=True)
    shutil.copy(ROOT / ".dvc" / "config", project / ".dvc" / "config")
    shutil.copytree(ROOT / ".dvc" / "plots", project / ".dvc" / "plots")
    shutil.copy(ROOT / "dvc.yaml", project / "dvc.yaml")
    for stage in paths.TRAIN_STAGES:
        loss = project / paths.plot_file(stage)
        loss.parent.mkdir(parents=True)
        loss.write_text("step\tloss\n" + "".join(f"{s}\t{5.0 / (1 + s)}\n" for s in range(0, 50, 10)))
        paths_val = project / paths.val_file(stage)  # evaluations are fewer than logged steps
        paths_val.write_text("step\tval_bpb\n" + "".join(f"{s}\t{3.0 - s / 40}\n" for s in (20, 40)))
    rl = project / "reports" / "rl"  # the rl stage's plots: reward per step, held-out pass@1/pass@k
    rl.mkdir(parents=True)
    (rl / "reward.tsv").write_text("step\treward\treply_tokens\tlr\n1\t0.47\t16.4\t1\n2\t0.51\t16.1\t0.97\n")
    (rl / "heldout.tsv").write_text("step\tpass1\tpassk\tlargest_pass1\tlargest_passk\n"
                                    "0\t0.38\t0.98\t0.38\t0.98\n200\t0.725\t0.82\t0.725\t0.82\n")
    for m, sc in SCORES.items():  # one file per evaluate stage
        scores = project / paths.plot_file(paths.eval_reports(m))
        scores.parent.mkdir(parents=True)
        scores.write_text("model\ttask\taccuracy\n" + "".join(f"{m}\t{t}\t{v}\n" for t, v in sc.items()))
    out = subprocess.run([sys.executable, "-m", "dvc", "plots", "show"], cwd=project,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return project / "dvc_plots" / "index.html"


def specs(page: Path) -> dict[str, dict]:
    """The Vega-Lite spec of each plot div, by div id (DVC writes `var spec = {...};` in each)."""
    html = page.read_text(encoding="utf-8")
    return {m.group(1): json.loads(m.group(2)) for m in
            re.finditer(r'<div id = "([^"]+)">\s*<script type = "text/javascript">\s*var spec = (.*?);\n', html)}


def test_dvc_plots_show_writes_a_page_without_external_scripts(plots_page):
    html = plots_page.read_text(encoding="utf-8")
    assert not SCRIPT_SRC.search(html), "dvc plots show wrote a page that loads scripts from elsewhere"
    assert "window.vegaEmbed=" in html


def test_eval_chart_groups_models_per_task(plots_page):
    by_id = specs(plots_page)
    assert len(by_id) == 2 * len(paths.TRAIN_STAGES) + 2 + 1, sorted(by_id)  # losses, val bpb, rl's two, the chart
    scores = next(s for s in by_id.values() if any("task" in d for d in s["data"]["values"]))
    enc = scores["encoding"]
    assert (enc["y"]["field"], enc["x"]["field"]) == ("task", "accuracy")
    assert enc["yOffset"]["field"] == enc["color"]["field"] == "model"
    assert enc["x"]["scale"]["zero"] is True  # bars start at zero
    assert {d["model"] for d in scores["data"]["values"]} == set(SCORES)
    losses = [s for i, s in by_id.items() if i.endswith("_loss_tsv")]
    assert len(losses) == len(paths.TRAIN_STAGES)
    assert '"field": "reward"' in json.dumps(by_id["reports_rl_reward_tsv"])
    for spec in losses:  # DVC's linear template, step against loss
        text = json.dumps(spec)
        assert '"field": "step"' in text and '"field": "loss"' in text



def y_field(spec: dict) -> str:
    """The field a DVC linear plot draws upward (its y encoding, in the spec or its first layer)."""
    layers = [spec, *spec.get("layer", [])]
    return next(layer["encoding"]["y"]["field"] for layer in layers if "y" in layer.get("encoding", {}))


def test_plots_show_what_each_stage_improved(plots_page):
    """rl's held-out plot draws pass@1 over the trained tasks (what RL raises), not the file's last column
    (pass@k, which RL may lower); each training stage has its validation bits per byte, evaluations only."""
    by_id = specs(plots_page)
    heldout = by_id["reports_rl_heldout_tsv"]
    assert y_field(heldout) == "pass1" and "pass@1" in json.dumps(heldout["title"])
    assert [float(d["pass1"]) for d in heldout["data"]["values"]] == [0.38, 0.725]
    for stage in paths.TRAIN_STAGES:
        val = by_id[f"reports_{stage}_val_tsv"]
        assert y_field(val) == "val_bpb" and "lower is better" in json.dumps(val["title"])
        assert [d["step"] for d in val["data"]["values"]] == ["20", "40"]  # no blank rows drawn as zero


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)")
def test_page_renders_offline_in_a_browser(plots_page):
    ARTIFACTS.mkdir(exist_ok=True)
    # every host fails to resolve and any proxy use goes to a closed port: nothing outside the file loads
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--host-resolver-rules=MAP * ~NOTFOUND",
               "--proxy-server=http://127.0.0.1:9", "--virtual-time-budget=5000", "--window-size=1200,1400"]
    url = plots_page.as_uri()
    shot = ARTIFACTS / "dvc_plots_offline.png"
    subprocess.run([*browser, f"--screenshot={shot}", url], capture_output=True, timeout=60, check=True)
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    dom = re.sub(r"<script\b[^>]*>.*?</script>", "", dom, flags=re.S | re.I)  # the bundle's own text
    charts = re.findall(r'<svg\b[^>]*class="marks"', dom)
    assert len(charts) == len(specs(plots_page)), f"{len(charts)} charts drawn; screenshot: {shot}"
    bars = dom.count('aria-roledescription="bar"')
    assert bars == sum(len(sc) for sc in SCORES.values()), f"{bars} bars drawn; screenshot: {shot}"
