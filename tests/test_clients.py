"""Real client libraries against the live server: LangChain's ChatOpenAI, LiteLLM, and
lm-evaluation-harness run as a user runs it (`lm_eval.simple_evaluate`), on small local datasets written here:
a log-likelihood multiple-choice task through `local-completions` (whose scores must be the model's
own, computed below with its forward) and a generation task through `local-chat-completions`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from model.chat import read_reply, render
from model.engine import Engine, EngineConfig
from model.requests import SamplingParams
from serve.api import Settings, create_app

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture(scope="module")
def server(serve_start, serve_model_dir):
    return serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False)))


# ---- LangChain ----

def test_langchain_chat_openai_invoke_and_stream(server):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model="sparkchat", base_url=server.url + "/v1", api_key="unused", temperature=0,
                     max_tokens=8, max_retries=0, timeout=60)
    r = llm.invoke("Hello! How are you today?")
    assert isinstance(r.content, str) and r.content
    assert r.response_metadata["finish_reason"] == "length" and r.usage_metadata["output_tokens"] == 8
    chunks = list(llm.stream("Hello! How are you today?"))
    assert "".join(c.content for c in chunks) == r.content  # greedy: the same reply, in pieces
    with_logprobs = llm.bind(logprobs=True, top_logprobs=2).invoke("Hello! How are you today?")
    content = with_logprobs.response_metadata["logprobs"]["content"]
    assert len(content) == 8 and all(len(e["top_logprobs"]) == 2 for e in content)


# ---- LiteLLM ----

def test_litellm_completion_plain_and_stream(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else it fetches a price list at import
    import litellm
    kw = dict(model="openai/sparkchat", api_base=server.url + "/v1", api_key="unused", messages=HI,
              max_tokens=8, temperature=0, num_retries=0)
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    pieces = [c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw)]
    assert "".join(pieces) == text
    penalised = litellm.completion(**{**kw, "max_tokens": 16}, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != litellm.completion(**{**kw, "max_tokens": 16}).choices[0].message.content


# ---- lm-evaluation-harness ----

QUESTIONS = ["The quick brown fox jumps over the", "Hello! How are you", "What is 12 + 30? It is",
             "A small model that chats, streams and", "Numbers: 1234567890. The", "I am fine, thank",
             "Café, naïve, résumé; and", "The lazy dog sleeps under the", "emoji and rockets go to the",
             "Batches requests on one", "How are you today? I am", "It is 42. The answer is"]
CHOICES = [["lazy dog", "quick fox", "blue sky", "red car"], ["today?", "there", "now", "doing"],
           ["42", "12", "30", "7"], ["batches", "sleeps", "runs", "eats"], ["end", "start", "middle", "number"],
           ["you", "me", "them", "us"], ["emoji", "words", "text", "accents"], ["tree", "table", "sun", "fox"],
           ["moon", "sea", "stars", "town"], ["CPU", "GPU", "day", "core"], ["fine", "tired", "here", "well"],
           ["42", "41", "forty", "none"]]


def lm_eval(model: str, model_args: str, task_dir: Path, task: str, **kw) -> dict:
    """lm-eval's Python entry point, as a user calls it, offline, with only our task (its TaskManager
    would otherwise index the thousands of tasks it ships: seconds of CPU). Returns its results, with
    the per-item samples sorted by item."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(name, "1")
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), **kw)
    out["samples"][task].sort(key=lambda s: s["doc_id"])
    return out


def mc_task(tmp_path: Path, task: str, docs: list[dict]) -> Path:
    """A folder holding one lm-eval multiple-choice task over `docs` ({context, choices, gold}) from a
    local JSON-lines file."""
    data = tmp_path / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / f"{task}.yaml").write_text(f"""task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
""")
    return tmp_path / "tasks"


@torch.no_grad()
def own_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """The model's log-likelihood of `continuation` after `context`, tokenized as lm-eval's causal
    models do it (the whole text, split where the context's ids end), from one forward."""
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    lp = torch.log_softmax(model(torch.tensor([whole]))[0].float(), dim=-1)
    return float(sum(lp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def test_lm_eval_loglikelihood_multiple_choice(server, serve_model, serve_tokenizer, serve_model_dir, tmp_path):
    docs = [{"context": q, "choices": c, "gold": i % 4} for i, (q, c) in enumerate(zip(QUESTIONS, CHOICES))]
    tasks = mc_task(tmp_path, "sparkchat_mc", docs)
    # a local model's tokenizer: the model directory's tokenizer.json, through transformers
    model_args = (f"model=sparkchat,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={serve_model_dir},max_length=128")
    results = lm_eval("local-completions", model_args, tasks, "sparkchat_mc")
    acc = results["results"]["sparkchat_mc"]["acc,none"]
    # the model's own scoring of the same items: the continuation is " " + choice (lm-eval's delimiter)
    own = [[own_loglikelihood(serve_model, serve_tokenizer, d["context"], " " + c) for c in d["choices"]] for d in docs]
    own_acc = sum(max(range(4), key=lambda k: lls[k]) == d["gold"] for lls, d in zip(own, docs)) / len(docs)
    print(f"lm-eval sparkchat_mc acc={acc:.4f}; the model's own scoring: {own_acc:.4f}")
    assert acc == pytest.approx(own_acc, abs=1e-9)
    for s, lls in zip(results["samples"]["sparkchat_mc"], own):  # each choice's log-likelihood too
        assert [float(r[0]) for r in s["filtered_resps"]] == pytest.approx(lls, abs=1e-3)
    assert 0 < own_acc < 1  # the items tell the choices apart (not all ties, not all one answer)


def test_lm_eval_generation_through_chat(server, serve_model, serve_tokenizer, tmp_path):
    """Half the targets are the model's own greedy replies (computed here, through the engine without
    HTTP), half are not: lm-eval's exact match through the chat API must be exactly 0.5."""
    questions = QUESTIONS[:8]
    engine = Engine(serve_model, EngineConfig(max_batch=2)).start()
    try:
        def reply(q: str) -> str:
            ids, _ = engine.generate(render(serve_tokenizer, [{"role": "user", "content": q}], for_completion=True)[0],
                                     SamplingParams(temperature=0, max_tokens=6))
            return read_reply(serve_tokenizer, ids).words.split("\n\n")[0]  # as the server shows a reply
        own = [reply(q) for q in questions]
    finally:
        engine.shutdown()
    docs = [{"question": q, "answer": own[i] if i % 2 == 0 else "not the model's reply"} for i, q in enumerate(questions)]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "sparkchat_gen.yaml").write_text(f"""task: sparkchat_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    results = lm_eval("local-chat-completions", f"model=sparkchat,base_url={server.url}/v1/chat/completions",
                      tmp_path / "tasks", "sparkchat_gen", apply_chat_template=True)
    score = results["results"]["sparkchat_gen"]["exact_match,none"]
    print(f"lm-eval sparkchat_gen exact_match={score:.4f} (0.5 by construction)")
    got = [s["filtered_resps"][0] for s in results["samples"]["sparkchat_gen"]]
    assert got == own  # every reply, not only the matching half, is the model's own greedy reply
    assert score == 0.5


def test_lm_eval_gives_the_evaluate_stages_accuracy_on_its_benchmark_items(server, serve_model, serve_tokenizer,
                                                                           serve_model_dir, tmp_path):
    """The evaluate stage's base-model scoring (pipeline/evaluate.py) and lm-eval's local-completions
    through /v1/completions, on the same fixture items in the hub schemas (ARC-Easy, MMLU, HellaSwag):
    every choice's log-likelihood agrees, and so does the accuracy under the stage's rule (the highest
    log-likelihood per token, CORE's)."""
    from model.scoring import score_continuations
    from pipeline.benchmarks import load_benchmark
    from pipeline.evaluate import loglikelihood_accuracy
    fixtures = Path(__file__).parent / "fixtures" / "evals"
    benches = [load_benchmark(name, str(fixtures / f"{name}.jsonl"), max_items=100)
               for name in ("arc_easy", "mmlu", "hellaswag")]
    tok, limit = serve_tokenizer, serve_model.config.seq_len - 1  # lm-eval cuts requests longer than this
    for b in benches:  # the items whose every request fits whole, so neither side cuts a context
        b.scored = [i for i in b.scored if all(1 + len(tok.encode(b.pool[i].context)) + len(tok.encode(" " + c))
                                               <= limit for c in b.pool[i].choices)]
    items = [b.pool[i] for b in benches for i in b.scored]
    stage_correct = sum(loglikelihood_accuracy(serve_model, serve_tokenizer, b) * len(b.scored) for b in benches)

    # the stage's requests start with <|bos|>; lm-eval's API models add none with this tokenizer, so the
    # task's text carries it (the transformers tokenizer reads it as the control id)
    docs = [{"context": "<|bos|>" + it.context, "choices": list(it.choices), "gold": it.gold} for it in items]
    tasks = mc_task(tmp_path, "sparkchat_bench", docs)
    model_args = (f"model=sparkchat,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={serve_model_dir},max_length={serve_model.config.seq_len}")
    samples = lm_eval("local-completions", model_args, tasks, "sparkchat_bench")["samples"]["sparkchat_bench"]
    lm_correct = 0
    for it, s in zip(items, samples):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        continuations = [tok.encode(" " + c) for c in it.choices]
        own = score_continuations(serve_model, [([tok.bos_id] + tok.encode(it.context), c) for c in continuations])
        assert lls == pytest.approx([o.logprob for o in own], abs=1e-3)
        per_token = [ll / len(c) for ll, c in zip(lls, continuations)]
        lm_correct += max(range(len(per_token)), key=per_token.__getitem__) == it.gold
    print(f"{len(items)} items: lm-eval {lm_correct}, the evaluate stage {stage_correct:.0f} right")
    assert lm_correct == round(stage_correct)
    assert 0 < lm_correct < len(items)
