"""The results pages and their raw files hold each other up: every raw file a page cites exists, every
raw file under bench/results is cited by a page, and every raw JSON file says what ran (its
`provenance`, written by `bench.stats.save_json`: `bench/provenance.py`)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.provenance import FIELDS, ROOT, code_files, provenance, tree_hash
from bench.stats import save_json

RESULTS = ROOT / "bench" / "results"


def pages(root: Path) -> list[Path]:
    """The pages that may cite a raw file: the results pages, bench/README.md, docs/ and the README."""
    return sorted([*(root / "bench" / "results").glob("*.md"), root / "bench" / "README.md",
                   *(root / "docs").glob("*.md"), root / "README.md"])


def raw_files(root: Path) -> list[str]:
    """Every file in an area's folder of bench/results, as `area/name` (the form pages cite)."""
    base = root / "bench" / "results"
    return sorted(p.relative_to(base).as_posix() for p in base.glob("*/**/*") if p.is_file()
                  and "__pycache__" not in p.parts)


def citations(text: str, areas: list[str]) -> set[str]:
    """The raw files a page's text names, as `area/name`: `serving/x.json` or `bench/results/serving/x.json`.
    `git show REV:bench/results/...` names a file of the past (a colon before it), not one of the tree."""
    pattern = (r"(?<![\w/.:-])(?:bench/results/)?((?:" + "|".join(map(re.escape, areas))
               + r")/[\w./-]*\w\.\w+)")
    return set(re.findall(pattern, text))


def check(root: Path) -> list[str]:
    """What is wrong with the pages and raw files under `root`, one line each."""
    raws = raw_files(root)
    areas = sorted({r.split("/")[0] for r in raws})
    problems, cited = [], set()
    for page in pages(root):
        for c in sorted(citations(page.read_text(), areas)):
            cited.add(c)
            if not (root / "bench" / "results" / c).is_file():
                problems.append(f"{page.relative_to(root)} cites bench/results/{c}, which does not exist")
    problems += [f"bench/results/{r} is cited by no page" for r in raws if r not in cited]
    for r in raws:
        if r.endswith(".json"):
            problems += [f"bench/results/{r}: {p}" for p in provenance_problems(root / "bench" / "results" / r)]
    return problems


def heading_problems(root: Path) -> list[str]:
    """A results page cited with a heading (`serving.md, "The collector"`, in a page or in code) must
    have that heading: the pages' tables move, the code's pointers must follow."""
    results: dict[str, set[str]] = {p.stem: set() for p in (root / "bench" / "results").glob("*.md")}
    for p in [*(root / "bench" / "results").glob("*.md"), *(root / "docs").glob("*.md")]:  # docs/serving.md too
        if p.stem in results:
            results[p.stem] |= {m.strip() for m in re.findall(r"^#+ (.+)$", p.read_text(), re.M)}
    listed = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=root, capture_output=True, text=True).stdout
    out = []
    for name in sorted(set(listed.split()) | {str(p.relative_to(root)) for p in pages(root)}):
        if not (root / name).is_file():
            continue
        for page, heading in re.findall(r"([\w-]+)\.md[`)\]]*,? \"([^\"]+)\"", (root / name).read_text()):
            heading = re.sub(r"\s*\n\s*#?\s*", " ", heading)  # wrapped, in a comment or not
            if page in results and heading not in results[page] and name != "bench/results/LOG.md":
                out.append(f"{name} cites {page}.md, \"{heading}\", which has no such heading")
    return out


def provenance_problems(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        return [f"not JSON ({e})"]
    prov = data.get("provenance") if isinstance(data, dict) else None
    if not isinstance(prov, dict):
        return ["no `provenance` record (what ran: bench.stats.save_json writes it)"]
    out = [f"provenance lacks `{k}`" for k in FIELDS if k not in prov]
    if not (prov.get("commit") or prov.get("base_commit") or prov.get("tree_hash")):
        out.append("provenance names no commit and no tree hash: which code ran is unknown")
    out += [f"provenance's `{k}` is empty" for k in ("command", "date") if not prov.get(k)]
    return out


def test_every_cited_raw_file_exists_every_raw_file_is_cited_and_says_what_ran():
    problems = check(ROOT)
    assert not problems, "\n".join(problems)


def test_every_cited_heading_of_a_results_page_exists():
    problems = heading_problems(ROOT)
    assert not problems, "\n".join(problems)


@pytest.fixture
def tree(tmp_path):
    """A copy of the pages and raw files, to plant faults in."""
    for p in pages(ROOT):
        dst = tmp_path / p.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(p.read_text())
    for r in raw_files(ROOT):
        dst = tmp_path / "bench" / "results" / r
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((RESULTS / r).read_bytes())
    assert check(tmp_path) == []
    return tmp_path


def test_a_cited_file_that_is_missing_fails(tree):
    page = tree / "bench" / "results" / "serving.md"
    page.write_text(page.read_text() + "\nRaw: `serving/gone.json`.\n")
    assert check(tree) == ["bench/results/serving.md cites bench/results/serving/gone.json, which does not exist"]


def test_a_raw_file_no_page_cites_fails(tree):
    (tree / "bench" / "results" / "serving" / "stray.log").write_text("a run\n")
    assert check(tree) == ["bench/results/serving/stray.log is cited by no page"]


def test_a_raw_file_without_a_commit_fails(tree):
    name = next(r for r in raw_files(tree) if r.endswith(".json"))
    path = tree / "bench" / "results" / name
    data = json.loads(path.read_text())
    for k in ("commit", "base_commit", "tree_hash"):
        data["provenance"][k] = None
    path.write_text(json.dumps(data))
    assert check(tree) == [f"bench/results/{name}: provenance names no commit and no tree hash: which code ran is unknown"]
    path.write_text(json.dumps({"no": "provenance"}))
    assert check(tree)[0].endswith("no `provenance` record (what ran: bench.stats.save_json writes it)")


def test_history_named_through_git_show_is_not_a_citation():
    assert citations("raw `git show abc1234:bench/results/serving/old.json`; now `serving/new.json`",
                     ["serving"]) == {"serving/new.json"}
    assert citations("model/precision/options.py", ["precision"]) == set()


def test_save_json_writes_what_ran(tmp_path):
    save_json({"x": 1}, tmp_path / "a" / "r.json")
    data = json.loads((tmp_path / "a" / "r.json").read_text())
    assert data["x"] == 1 and list(data)[0] == "provenance"
    prov = data["provenance"]
    assert set(FIELDS) <= set(prov)
    assert prov["command"] and prov["date"] and prov["host"]["cpu_count"] >= 1
    assert prov["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0 and Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT,
                                                    capture_output=True, text=True).stdout.strip()) == ROOT:
        assert prov["base_commit"] == head.stdout.strip()
        assert prov["commit"] == (None if prov["dirty"] else prov["base_commit"])
    assert prov["tree_hash"] == provenance()["tree_hash"]


def test_the_tree_hash_is_the_same_with_and_without_git():
    """A GPU host may get the tree without its history: the hash must still name the same code."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    assert code_files(True) == code_files(False)
    assert tree_hash(True) == tree_hash(False)


def test_a_cited_heading_that_is_gone_fails(tree):
    for p in (ROOT / "docs").glob("*.md"):  # the headings of docs/serving.md count too
        (tree / "docs" / p.name).write_text(p.read_text())
    assert heading_problems(tree) == []
    readme = tree / "README.md"
    readme.write_text(readme.read_text() + "\nSee bench/results/serving" + '.md, "Trees in\nturn".\n')
    assert heading_problems(tree) == ["README.md cites serving" + '.md, "Trees in turn", which has no such heading']


def test_raw_json_is_compact_and_the_same_json():
    from bench.stats import dumps
    data = {"losses": [round(1 / (i + 1), 6) for i in range(1000)], "spread": {"median": 1.0, "min": 0.5, "max": 2},
            "rounds": [{"tokens": i, "text": "ü"} for i in range(3)], "empty": [], "none": None}
    text = dumps(data)
    assert json.loads(text) == data
    assert len(text.splitlines()) < 150  # 1,000 numbers a few to a line, not one a line
    assert max(len(line) for line in text.splitlines()) <= 100
    assert '"spread": {"median": 1.0, "min": 0.5, "max": 2}' in text and "ü" in text
