"""prepare's sources and splits: real loaders on small local files; held-out items never trained on."""
from __future__ import annotations

import json

import datasets
import pytest

from pipeline import synthetic
from pipeline.config import params_from_dict
from pipeline.prepare import chunk_document, prepare
from pipeline.sources import SourceError, iter_conversations, iter_texts, row_to_messages
from model.calculator import calculate


def test_local_text_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n\nsecond paragraph")
    rows = [{"text": "one"}, {"text": "two"}, {"body": "x"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]))
    datasets.Dataset.from_dict({"text": ["p1", "p2", "p3"]}).to_parquet(str(tmp_path / "c.parquet"))
    assert list(iter_texts(str(tmp_path / "a.txt"))) == ["hello world\n\nsecond paragraph"]
    assert list(iter_texts(str(tmp_path / "b.jsonl"))) == ["one", "two"]
    assert list(iter_texts(str(tmp_path / "c.parquet"), max_docs=2)) == ["p1", "p2"]
    with pytest.raises(SourceError, match="no column 'text'"):
        (tmp_path / "d.jsonl").write_text(json.dumps(rows[2]))
        list(iter_texts(str(tmp_path / "d.jsonl")))
    with pytest.raises(SourceError, match="does not exist"):
        list(iter_texts(str(tmp_path / "missing.txt")))


def test_hub_style_chat_rows_convert(tmp_path):
    """SmolTalk-style `messages` and GSM8K-style question/answer rows, read from local files the way a
    hub dataset's rows arrive."""
    smol = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    gsm = [{"question": "1+1?", "answer": "1+1=2\n#### 2"}]
    (tmp_path / "smol.jsonl").write_text("\n".join(json.dumps(r) for r in smol))
    datasets.Dataset.from_list(gsm).to_parquet(str(tmp_path / "gsm.parquet"))
    assert list(iter_conversations(str(tmp_path / "smol.jsonl")))[0][1]["content"] == "hello"
    assert list(iter_conversations(str(tmp_path / "gsm.parquet")))[0][0]["content"] == "1+1?"
    assert row_to_messages({"x": 1}) is None


def test_builtin_sources_are_real_text():
    texts = list(iter_texts("builtin:shakespeare", max_docs=2))
    assert len(texts) == 2 and all(len(t) > 10_000 for t in texts)
    convs = list(iter_conversations("builtin:chatterbot", max_docs=5))
    assert len(convs) == 5 and convs[0][0]["role"] == "user"


def test_synthetic_items_are_correct_and_seeded():
    a, b = synthetic.generate_train(200, seed=3), synthetic.generate_train(200, seed=3)
    assert a == b
    for it in a:
        calls = [p["text"] for p in it["parts"] if p["type"] == "python"]
        outs = [p["text"] for p in it["parts"] if p["type"] == "python_output"]
        assert [calculate(c) for c in calls] == outs
        if calls:
            assert outs[-1] == it["answer"]


def test_held_out_items_leave_training_half_of_a_small_pool():
    """generate_eval: the first n distinct prompts of a task, the same at any n (a prefix), but at most half
    of the distinct prompts its draws found: spelling's pool is 387 prompts, so it holds out 193."""
    big, small = synthetic.generate_eval(400, seed=5), synthetic.generate_eval(100, seed=5)
    assert {t: len(v) for t, v in big.items()} == {t: 193 if t == "spelling" else 400 for t in synthetic.EVAL_TASKS}
    assert all(big[t][:100] == small[t] for t in synthetic.EVAL_TASKS)
    assert all(len({it["prompt"] for it in v}) == len(v) for v in big.values())


def test_synthetic_items_come_alone_and_again_in_multi_turn_conversations():
    items = synthetic.generate_train(300, seed=3)
    convs = synthetic.conversations(items, 0.5, seed=5)
    alone, multi = convs[:300], convs[300:]
    assert alone == [synthetic.to_messages(it) for it in items]  # as the evals ask
    again = [m for c in multi for m in c]
    assert len(again) == 2 * 150 and all(m in [x for it in items for x in synthetic.to_messages(it)] for m in again)
    assert {len(c) // 2 for c in multi[:-1]} == set(synthetic.MULTI_TURNS)
    assert all(c[-1]["role"] == "assistant" for c in multi)
    assert synthetic.conversations(items, 0.0, seed=5) == alone


def test_chunking_keeps_all_text():
    doc = "\n\n".join(f"paragraph {i} " * 20 for i in range(100))
    chunks = chunk_document(doc, size=1000)
    assert len(chunks) > 5
    assert "".join(chunks).replace("\n", "").replace(" ", "") == doc.replace("\n", "").replace(" ", "")


def test_prepare_holds_out_eval_items(tmp_path):
    (tmp_path / "t.txt").write_text("\n\n".join(f"Some words number {i}." for i in range(4000)))
    p = params_from_dict({"data": {"pretrain_sources": [str(tmp_path / "t.txt")], "chat_sources": ["builtin:synthetic"],
                                   "synthetic_train": 6000, "synthetic_eval": 300, "val_fraction": 0.1}})
    out = tmp_path / "data"
    stats = prepare(p, out)
    held = set()
    for f in (out / "eval").glob("*.jsonl"):
        if f.stem != "tool_use":  # its items are held out by prompt and functions offered (below)
            held |= {synthetic.normalize_prompt(json.loads(l)["prompt"]) for l in f.read_text().splitlines()}
    from pipeline import tool_tasks
    tool_held = {tool_tasks.key(json.loads(l)) for l in (out / "eval" / "tool_use.jsonl").read_text().splitlines()}
    assert len(held) > 1000
    # the generator does produce eval prompts in training by chance; prepare must have dropped them all
    raw = {synthetic.normalize_prompt(it["prompt"]) for it in synthetic.generate_train(6000, p.data.seed)}
    assert raw & held, "test is vacuous: no collision to remove"
    for name in ("mid_train", "sft_train", "chat_val"):
        convs = [json.loads(m) for m in datasets.Dataset.from_parquet(str(out / f"{name}.parquet"))["messages"]]
        prompts = {synthetic.normalize_prompt(t["content"]) for c in convs if isinstance(c, list) for t in c
                   if t["role"] == "user"}
        assert not prompts & held, name
        tool_keys = {(c["messages"][0]["content"], tuple(f["name"] for f in c["tools"])) for c in convs
                     if isinstance(c, dict)}
        assert tool_keys and not tool_keys & tool_held, name
    assert stats["chat_train"] > 0 and stats["pretrain_val_chars"] > 0


@pytest.mark.parametrize("expr", ["1000000.0**64", "(-8)**0.5", "((0-1)**0.5)*0", "1e308*10", "1e308+1e308",
                                  "10**64", "1/0", "2**", "__import__('os')"])
def test_calculator_failures_are_the_tools_error(expr):
    """Overflow, complex results, inf and nan: each ends as the tool's error output, never an
    exception escaping to the engine (which would feed the model nothing)."""
    from model.calculator import CalculatorError, try_calculate
    with pytest.raises(CalculatorError):
        calculate(expr)
    assert try_calculate(expr) == "error"


def test_the_calculators_guard_counts_cpu_time_not_waiting(monkeypatch):
    """The guard stops an evaluation that burns CPU, never one whose process merely waits (for a core on a
    loaded machine: a wall-clock alarm failed `prepare`'s trivial sums there)."""
    import time

    from model import calculator

    def waits(tree):
        time.sleep(1.0)  # off the CPU, as a descheduled process is
        return 4

    monkeypatch.setattr(calculator, "_eval", waits)
    # (the guard counts the whole process's CPU: a margin for the session's other threads meanwhile)
    assert calculator.calculate("2 + 2", timeout_s=0.25) == "4"

    def burns(tree):
        end = time.process_time() + 0.5
        while time.process_time() < end:
            pass
        return 4

    monkeypatch.setattr(calculator, "_eval", burns)
    with pytest.raises(calculator.CalculatorError, match="timed out"):
        calculator.calculate("2 + 2", timeout_s=0.05)
