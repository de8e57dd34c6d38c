"""The evaluate stage's benchmarks: the committed fixtures are in the hub datasets' own schemas and read
through `datasets`; each schema becomes the right items; the log-likelihood scorer (model/scoring.py)
gives what one unbatched forward per request gives; every benchmark produces a score from a real
(tiny, random) model, by log-likelihood and by generation; and bits per byte counts each byte once."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from model.chat_engine import chat_engine
from model.loss_eval import token_bytes
from model.scoring import score_continuations
from pipeline import benchmarks as bm
from pipeline import evaluate as ev
from pipeline.config import BenchmarksParams, params_from_dict
from project_files import committed_text

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "evals"
# the hub datasets' columns, exactly (allenai/ai2_arc, cais/mmlu, Rowan/hellaswag, EleutherAI/lambada_openai,
# openai/gsm8k main)
HUB_COLUMNS = {
    "arc_easy": {"id", "question", "choices", "answerKey"},
    "arc_challenge": {"id", "question", "choices", "answerKey"},
    "mmlu": {"question", "subject", "choices", "answer"},
    "hellaswag": {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type",
                  "label"},
    "lambada": {"text"},
    "gsm8k": {"question", "answer"},
}


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()]


def test_every_task_has_a_params_block_and_params_yaml_reads_the_fixtures():
    assert set(bm.TASKS) == {f.name for f in dataclasses.fields(BenchmarksParams)} == set(HUB_COLUMNS)
    p = params_from_dict(yaml.safe_load(committed_text(ROOT, "params.yaml")), ROOT / "profiles")
    for name in bm.TASKS:
        assert getattr(p.evaluate.benchmarks, name).source == f"tests/fixtures/evals/{name}.jsonl"


@pytest.mark.parametrize("name", sorted(HUB_COLUMNS))
def test_fixture_is_in_the_hub_schema_and_loads_through_datasets(name):
    for row in rows(name):
        assert set(row) == HUB_COLUMNS[name]
    b = bm.load_benchmark(name, str(FIXTURES / f"{name}.jsonl"), max_items=100)
    assert len(b.pool) == len(b.scored) == len(rows(name)) >= 8
    if b.task.kind == "choice":
        assert all(0 <= it.gold < len(it.choices) and it.answer == bm.LETTERS[it.gold] for it in b.pool)


def test_types_as_on_the_hub():
    assert all(isinstance(r["answer"], int) for r in rows("mmlu"))
    assert all(isinstance(r["label"], str) and isinstance(r["ind"], int) for r in rows("hellaswag"))
    assert all(isinstance(r["choices"]["label"], list) for r in rows("arc_easy"))


def test_items_from_each_schema():
    arc = bm.arc({"id": "x", "question": "Which is a mammal?", "answerKey": "2",
                  "choices": {"text": ["frog", "whale", "shark"], "label": ["1", "2", "3"]}})
    assert (arc.context, arc.choices, arc.gold, arc.answer) == ("Question: Which is a mammal?\nAnswer:",
                                                                ("frog", "whale", "shark"), 1, "B")
    assert arc.prompt == "Which is a mammal? A) frog B) whale C) shark\nAnswer with the letter."
    m = bm.mmlu({"question": " 2+2? ", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1})
    assert m.context == "2+2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:" and m.choices == ("A", "B", "C", "D") and m.gold == 1
    h = bm.hellaswag({"activity_label": "Home", "ctx_a": "[header] How to x [title] Do y.", "ctx_b": "[step] then z.",
                      "endings": ["[substeps] a  b.", "c."], "label": "1"})
    # the harness's cleaning: "[title]" ends a sentence, other markup goes, double spaces become one
    assert h.context == "Home: How to x. Do y. then z." and h.choices == (" a b.", "c.") and h.gold == 1
    lam = bm.lambada({"text": "the cat sat on the mat"})
    assert (lam.context, lam.choices) == ("the cat sat on the", ("mat",))
    answers = [bm.gsm8k(r).answer for r in rows("gsm8k")]
    assert {"1350", "-4", "7.5"} <= set(answers)  # '1,350' in the worked answer; '#### 1350' is the answer
    with pytest.raises(bm.BenchmarkError, match="answerKey 'E'"):
        bm.arc({"question": "q", "answerKey": "E", "choices": {"text": ["a"], "label": ["A"]}})


def test_letter_extraction():
    for reply, want in [("B", "B"), ("B) the Sun", "B"), ("(C)", "C"), ("The answer is D.", "D"),
                        ("A chat, but", ""), ("E", ""), ("no idea", "")]:
        assert bm.chosen_letter(reply, 4) == want, reply
    assert bm.final_answer("so 12 + 3 = 15.\n#### 1,200") == "1200"
    assert bm.same_number(bm.final_answer("She spends 7.50 dollars."), "7.5") and not bm.same_number("7", "7.5")


def test_parquet_source_and_sampling(tmp_path):
    import datasets
    path = tmp_path / "arc.parquet"
    datasets.load_dataset("json", data_files=str(FIXTURES / "arc_easy.jsonl"), split="train").to_parquet(str(path))
    from_json = bm.load_benchmark("arc_easy", str(FIXTURES / "arc_easy.jsonl"), max_items=100)
    from_parquet = bm.load_benchmark("arc_easy", str(path), max_items=100)
    assert from_parquet.pool == from_json.pool
    sample = bm.load_benchmark("arc_easy", str(path), max_items=5, shots=3)
    assert len(sample.scored) == 5 and sample.scored == bm.load_benchmark("arc_easy", str(path), 5).scored
    for i in sample.scored:  # few-shot examples: 3 other items, the same draw every time
        shown = sample.examples(i)
        assert len(shown) == 3 and sample.pool[i] not in shown and shown == sample.examples(i)


def test_a_source_without_the_schema_names_the_field(tmp_path):
    bad = tmp_path / "mmlu.jsonl"
    bad.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "label": 0}) + "\n")
    with pytest.raises(bm.BenchmarkError, match=r"mmlu: .*mmlu.jsonl.: row 0 has no field .answer."):
        bm.load_benchmark("mmlu", str(bad), 10)


def reference(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of log p and greedy flag from one forward over exactly this request."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids[:, :-1])[0].float(), -1)[len(ctx) - 1:]
    target = torch.tensor(cont)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def test_scorer_matches_one_forward_per_request(serve_model, serve_tokenizer):
    tok = serve_tokenizer
    texts = [("The quick brown fox", " jumps"), ("Hello!", " How are you today? I am fine"), ("A", " small model"),
             ("What is 12 + 30?", " It is 42.")]
    requests = [([tok.bos_id] + tok.encode(c), tok.encode(x)) for c, x in texts]
    got = score_continuations(serve_model, requests, batch_tokens=40)  # several batches of different lengths
    for (ctx, cont), g in zip(requests, got):
        logprob, greedy = reference(serve_model, ctx, cont)
        assert g.tokens == len(cont) and g.logprob == pytest.approx(logprob, abs=1e-4) and g.greedy == greedy
    # too long for the context: the first tokens are cut, and the result is that of the cut request
    ctx, cont = requests[1]
    cut = score_continuations(serve_model, [(ctx, cont)], max_len=8)[0]
    keep = (ctx + cont)[-8:]
    assert cut.tokens == min(len(cont), 7)
    assert cut.logprob == pytest.approx(reference(serve_model, keep[:-cut.tokens], keep[-cut.tokens:])[0], abs=1e-4)
    # the model's own greedy continuation is greedy; another last token is not
    ids = [tok.bos_id] + tok.encode("The quick")
    greedy = []
    for _ in range(4):
        with torch.no_grad():
            greedy.append(int(serve_model(torch.tensor([ids + greedy]))[0, -1].argmax()))
    other = greedy[:-1] + [(greedy[-1] + 1) % tok.vocab_size]
    a, b = score_continuations(serve_model, [(ids, greedy), (ids, other)])
    assert a.greedy and not b.greedy and a.logprob > b.logprob


@pytest.fixture(scope="module")
def fixture_benchmarks():
    """Every benchmark from its fixture, with few-shot examples (more than fit in the tiny model's
    context for some items, so the fitting path runs too)."""
    return [bm.load_benchmark(name, str(FIXTURES / f"{name}.jsonl"), max_items=6, shots=2) for name in bm.TASKS]


def test_loglikelihood_accuracy_is_the_argmax_of_the_reference(serve_model, serve_tokenizer, fixture_benchmarks):
    tok = serve_tokenizer
    for b in fixture_benchmarks:
        if b.task.kind != "choice":
            continue
        b0 = dataclasses.replace(b, shots=0)
        right = 0
        for i in b0.scored:
            item = b0.pool[i]
            ctx = [tok.bos_id] + tok.encode(item.context)
            means = []
            for c in item.choices:
                cont = tok.encode(" " + c)
                means.append(reference(serve_model, ctx, cont)[0] / len(cont))
            right += max(range(len(means)), key=means.__getitem__) == item.gold
        assert ev.loglikelihood_accuracy(serve_model, tok, b0) == pytest.approx(right / len(b0.scored)), b.name


def test_every_benchmark_scores_by_loglikelihood_and_by_generation(serve_model, serve_tokenizer, fixture_benchmarks):
    engine = chat_engine(serve_model, serve_tokenizer, {"tool_use": False}, max_batch=8, max_queue=1000)
    try:
        base = ev.benchmark_scores("base", serve_model, serve_tokenizer, engine, fixture_benchmarks, max_new=6)
        chat = ev.benchmark_scores("sft", serve_model, serve_tokenizer, engine, fixture_benchmarks, max_new=6)
    finally:
        engine.shutdown()
    assert set(base) == {"arc_easy", "arc_challenge", "mmlu", "hellaswag", "lambada"}
    assert set(chat) == {"arc_easy", "arc_challenge", "mmlu", "hellaswag", "gsm8k"}
    assert all(0.0 <= v <= 1.0 for v in [*base.values(), *chat.values()])
    chance = {b.name: b.chance for b in fixture_benchmarks}
    assert chance["lambada"] == chance["gsm8k"] == 0.0 and chance["mmlu"] == 0.25
    assert 0.2 < chance["arc_easy"] < 0.34  # items with 3, 4 and 5 choices
    c = ev.centered(base, chance, fixture_benchmarks, chat=False)
    assert c["mmlu"] == pytest.approx(round((base["mmlu"] - 0.25) / 0.75, 4))
    assert c["core"] == pytest.approx(sum(c[t] for t in base) / len(base), abs=1e-4)
    assert "chatcore" in ev.centered(chat, chance, fixture_benchmarks, chat=True)


def test_bits_per_byte_counts_every_utf8_byte_of_the_text_once(serve_tokenizer):
    """token_bytes, bits per byte's denominator: a text's ids add up to its UTF-8 length, characters cut
    between tokens and ones the tokenizer never saw in training included; special ids count nothing."""
    text = "Hello, wörld! 37 + 58 = 95 \u2713 \u65e5\u672c\u8a9e \U0001f642\n  tabs\tand spaces"
    ids = serve_tokenizer.encode(text)
    tbytes = token_bytes(serve_tokenizer, "cpu")
    assert tbytes.shape == (serve_tokenizer.vocab_size,)
    assert int(tbytes[ids].sum()) == len(text.encode("utf-8"))
    assert not tbytes[sorted(serve_tokenizer.special_ids)].any()
