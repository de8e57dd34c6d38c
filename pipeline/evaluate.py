"""Stage `evaluate@<model>`: how good one of the base, midtrained and SFT models is, on items none of them
trained on (`python -m pipeline.evaluate sft`; one DVC stage per model, so a changed model re-scores only
itself, and its files are verified before any scoring starts).

- base val bits per byte (pretraining text), for every model;
- the synthetic tasks the default data teaches, for every model through the chat template: generative,
  greedy, with the calculator tool if the model's generation.json allows it: arithmetic, word problems
  (the number after '####' or the last number), letter counting, spelling (exact answer), chance ~0;
  multiple choice (largest of four numbers): the letter with the highest logit, chance 25%;
- tool use (pipeline/tool_tasks.py), for a model whose tokenizer has the tool tokens: each held-out prompt
  with two made-up functions, greedy; `tool_call`: of the items where one fits, the share whose reply calls
  it with valid, right arguments; `tool_none`: of the items where none fits, the share with no call;
- the field's benchmarks (`evaluate.benchmarks`, pipeline/benchmarks.py: ARC-Easy/Challenge, MMLU,
  HellaSwag, LAMBADA, GSM8K) read through `datasets`. The base and midtrained models are scored by
  log-likelihood as nanochat's CORE scores a base model (the choice with the highest log-likelihood per
  token; LAMBADA's last word must be the greedy continuation); the SFT model, a chat model, by
  generation: its reply's letter, or GSM8K's number. Beside each accuracy: chance, and the centred
  accuracy (accuracy - chance) / (1 - chance), whose mean over the benchmarks is reported as `core`
  (log-likelihood) or `chatcore` (generation), as nanochat names them. nanochat's CORE averages 22
  tasks, so these means compare only with each other.

Writes its headline metrics, details and a scores plot where `sparkchat.paths.eval_reports` says.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from model.chat import read_reply, render
from model.chat_engine import chat_engine, run_all
from model.engine import Engine
from model.requests import SamplingParams
from model.loss_eval import evaluate_bpb, token_bytes
from model.model_dir import ModelDirError, load_model_dir
from model.scoring import score_continuations
from model.tools import has_tools

from sparkchat import paths

from .benchmarks import CHAT_KINDS, LOGLIKELIHOOD_KINDS, Benchmark, BenchmarkError, chosen_letter, load_benchmark
from .config import Params, load_params, resolve_source
from .data import TokenStream, open_tokens
from .metrics import VAL_BPB, atomic_write_text, write_reports
from .runtime import resolve_device
from . import tool_tasks
from .tasks import GENERATIVE, MULTIPLE_CHOICE, is_correct, reply_text

TOOL_USE = ("tool_call", "tool_none")  # tool_tasks.score's keys: right call when one fits, no call when none does

CHAT_MODELS = ("sft", "rl")  # scored on the benchmarks by generation; the others by log-likelihood

def generate_all(engine: Engine, tok, prompts: list[list[int]], max_new: int, desc: str) -> list[str]:
    """Submit every prompt at once; the engine batches them. Returns the replies as text (the part
    after the last tool output, which is what the model itself concluded)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    with tqdm(total=len(prompts), desc=desc, file=sys.stderr, mininterval=2.0, leave=False) as bar:
        done = run_all(engine, [(ids, params) for ids in prompts], bar)
    return [reply_text(tok, [t.id for t in tokens]) for tokens, _ in done]


@torch.no_grad()
def tool_use_scores(engine: Engine, tok, items: list[dict], max_new: int, name: str
                    ) -> tuple[dict[str, float], dict[str, dict[str, int]]]:
    """The tool-use task (pipeline/tool_tasks.py) on held-out items, greedy: each prompt rendered with its
    two functions; `tool_call` and `tool_none` from the calls each reply made, and how the others failed
    (tool_tasks.failures). Items whose prompt leaves the model's context no room for a reply are left out
    (a context too short for any: not scored)."""
    rendered = [render(tok, [{"role": "user", "content": it["prompt"]}], for_completion=True, tools=it["tools"])[0]
                for it in items]
    fits = [i for i, ids in enumerate(rendered) if len(ids) < engine.max_len]
    if not fits:
        return {}, {}
    items, prompts = [items[i] for i in fits], [rendered[i] for i in fits]
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    with tqdm(total=len(prompts), desc=f"{name}/tool_use", file=sys.stderr, mininterval=2.0, leave=False) as bar:
        done = run_all(engine, [(ids, params) for ids in prompts], bar)
    calls = [[p["text"] for p in read_reply(tok, [t.id for t in tokens]).parts if p["type"] == "call"]
             for tokens, _ in done]
    return tool_tasks.score(items, calls), tool_tasks.failures(items, calls)


def multiple_choice(model, tok, items: list[dict], device) -> float:
    correct = 0
    for it in items:
        ids, _ = render(tok, [{"role": "user", "content": it["prompt"]}], for_completion=True)
        logits = model(torch.tensor([ids], device=device))[0, -1]
        letter_ids = [tok.encode(c)[0] for c in it["choices"]]
        pred = it["choices"][int(torch.stack([logits[i] for i in letter_ids]).argmax())]
        correct += pred == it["answer"]
    return correct / max(1, len(items))


def load_eval_items(task: str, n: int) -> list[dict]:
    with open(paths.EVAL_ITEMS / f"{task}.jsonl") as f:
        return [json.loads(line) for line in f][:n]


def _fitted(build: Callable[[int], list[int]], shots: int, limit: int) -> list[int]:
    """build(k) for the most few-shot examples k <= shots whose ids fit in `limit` tokens (build(0) if
    none do: the caller cuts it)."""
    for k in range(shots, 0, -1):
        ids = build(k)
        if len(ids) <= limit:
            return ids
    return build(0)


def loglikelihood_accuracy(model, tok, bench: Benchmark) -> float:
    """Multiple choice: right when the gold choice has the highest log-likelihood per token (CORE). Language
    modelling: right when every token of the continuation is the model's greedy choice."""
    limit = model.config.seq_len
    requests, spans = [], []
    for i in bench.scored:
        item, examples = bench.pool[i], bench.examples(i)
        continuations = [tok.encode(" " + c) for c in item.choices]
        longest = max(map(len, continuations))

        def context(k: int, item=item, examples=examples) -> list[int]:
            shown = "".join(f"{ex.context} {ex.choices[ex.gold]}\n\n" for ex in examples[:k])
            return [tok.bos_id] + tok.encode(shown + item.context)

        ids = _fitted(context, len(examples), limit - longest)
        spans.append((len(requests), len(continuations)))
        requests.extend((ids, c) for c in continuations)
    results = score_continuations(model, requests, max_len=limit)  # cuts what still does not fit from the left
    correct = 0
    for i, (start, n) in zip(bench.scored, spans):
        options = results[start:start + n]
        if bench.task.kind == "lm":
            correct += options[0].greedy
        else:
            best = max(range(n), key=lambda j: options[j].mean_logprob)
            correct += best == bench.pool[i].gold
    return correct / len(bench.scored)


def chat_accuracy(engine: Engine, tok, bench: Benchmark, max_new: int, desc: str) -> float:
    """The reply's letter (multiple choice) or final number (GSM8K) against the answer. Few-shot examples
    are earlier turns of the conversation."""
    limit = engine.max_len - min(max_new, engine.max_len // 4)  # room for the answer
    prompts = []
    for i in bench.scored:
        item, examples = bench.pool[i], bench.examples(i)

        def conversation(k: int, item=item, examples=examples) -> list[int]:
            turns = [m for ex in examples[:k] for m in ({"role": "user", "content": ex.prompt},
                                                         {"role": "assistant", "content": ex.reply})]
            return render(tok, turns + [{"role": "user", "content": item.prompt}], for_completion=True)[0]

        prompts.append(_fitted(conversation, len(examples), limit)[-limit:])
    replies = generate_all(engine, tok, prompts, max_new, desc)
    correct = 0
    for i, reply in zip(bench.scored, replies):
        item = bench.pool[i]
        if bench.task.kind == "choice":
            correct += chosen_letter(reply, len(item.choices)) == item.answer
        else:
            correct += is_correct("gsm8k", reply, item.answer)
    return correct / len(bench.scored)


def benchmark_scores(name: str, model, tok, engine: Engine, benches: list[Benchmark], max_new: int) -> dict:
    """Accuracy of one model on each benchmark it is scored on (by generation if it is a chat model)."""
    chat = name in CHAT_MODELS
    scores = {}
    for b in benches:
        if b.task.kind not in (CHAT_KINDS if chat else LOGLIKELIHOOD_KINDS):
            continue
        acc = chat_accuracy(engine, tok, b, max_new, f"{name}/{b.name}") if chat else loglikelihood_accuracy(model, tok, b)
        scores[b.name] = round(acc, 4)
    return scores


def centered(scores: dict, chance: dict, benches: list[Benchmark], chat: bool) -> dict:
    """(accuracy - chance) / (1 - chance) per benchmark, and their mean (`core`, or `chatcore` for a chat model)."""
    out = {b.name: round((scores[b.name] - chance[b.name]) / (1 - chance[b.name]), 4)
           for b in benches if b.name in scores}
    if out:
        out["chatcore" if chat else "core"] = round(sum(out.values()) / len(out), 4)
    return out


def evaluate_model(name: str, path: Path, p: Params, device, benches: list[Benchmark], dtype=torch.float32,
                   load=load_model_dir, failures: dict | None = None) -> dict:
    """`dtype` and `load(path, device, dtype)`: how the model is loaded (bench/fp8_quality.py scores a model
    as the server would hold it). `failures`, when given, receives how the tool-use replies failed."""
    model, tok, gen = load(path, device, dtype)
    scores: dict[str, float] = {}
    seq_len = model.config.seq_len
    val = TokenStream(open_tokens(paths.PRETRAIN_VAL_TOKENS, tok).ids, 8, seq_len)
    n_batches = max(1, min(16, val.micro_steps_per_epoch))
    scores["val_bpb"] = round(evaluate_bpb(model, val, n_batches, token_bytes(tok, device), device,
                                           torch.no_grad()), 4)
    engine = chat_engine(model, tok, gen, max_batch=32, max_queue=100_000)  # every prompt is queued at once
    try:
        for task in GENERATIVE:
            items = load_eval_items(task, p.evaluate.max_items)
            prompts = [render(tok, [{"role": "user", "content": it["prompt"]}], for_completion=True)[0] for it in items]
            replies = generate_all(engine, tok, prompts, p.evaluate.max_new_tokens, f"{name}/{task}")
            scores[task] = round(sum(is_correct(task, r, it["answer"]) for r, it in zip(replies, items)) / len(items), 4)
        for task in MULTIPLE_CHOICE:
            scores[task] = round(multiple_choice(model, tok, load_eval_items(task, p.evaluate.max_items), device), 4)
        if has_tools(tok):  # a model whose tokenizer predates the tool tokens takes no tools
            tool_scores, tool_failures = tool_use_scores(engine, tok, load_eval_items("tool_use", p.evaluate.max_items),
                                                         p.evaluate.max_new_tokens, name)
            scores.update(tool_scores)
            if failures is not None:
                failures.update(tool_failures)
        scores.update(benchmark_scores(name, model, tok, engine, benches, p.evaluate.max_new_tokens))
    finally:
        engine.shutdown()
    return scores


def load_benchmarks(p: Params) -> list[Benchmark]:
    """Every benchmark with a source, read before any model is: a bad source stops the stage at once."""
    return [load_benchmark(name, resolve_source(b.source), p.evaluate.max_items, b.shots)
            for name, b in vars(p.evaluate.benchmarks).items() if b.source]


def reports(name: str, scores: dict, benches: list[Benchmark], tool_failures: dict | None = None
            ) -> tuple[dict, dict, str]:
    """One model's headline metrics (the synthetic tasks, val bits per byte on the pretraining text, the
    benchmarks' centred mean), its details (each benchmark, centred scores, chance, the tool-use failures
    per function) and its plot rows."""
    chat = name in CHAT_MODELS
    chance = {"largest": 0.25, **{t: 0.0 for t in GENERATIVE}, **{b.name: round(b.chance, 4) for b in benches}}
    bench_scores = {b.name: scores[b.name] for b in benches if b.name in scores}
    c = centered(scores, chance, benches, chat)
    headline = {t: scores[t] for t in (*GENERATIVE, *MULTIPLE_CHOICE, *TOOL_USE) if t in scores}
    headline[VAL_BPB["pretrain"]] = scores["val_bpb"]  # the same held-out text as pretrain's figure
    mean = "chatcore" if chat else "core"
    if mean in c:  # one column in `dvc metrics show` for both: the row says which model, details.json which mean
        headline["core"] = c[mean]
    details = {"benchmarks": bench_scores, "centered": c, "chance": chance}
    if tool_failures is not None:
        details["tool_failures"] = tool_failures
    rows = ["model\ttask\taccuracy"] + [f"{name}\t{t}\t{v}" for t, v in {**headline, **bench_scores}.items()
                                         if t != VAL_BPB["pretrain"] and t != "core"]
    return headline, details, "\n".join(rows) + "\n"


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in paths.EVAL_MODELS:
        raise SystemExit(f"usage: python -m pipeline.evaluate MODEL, MODEL one of {', '.join(paths.EVAL_MODELS)}")
    name = args[0]
    p = load_params(stage="evaluate")
    device = resolve_device(p.runtime.device)
    try:
        benches = load_benchmarks(p)
    except BenchmarkError as e:
        raise SystemExit(f"evaluate: evaluate.benchmarks.{e}") from None
    failures: dict = {}
    try:
        scores = evaluate_model(name, paths.EVAL_MODELS[name], p, device, benches, failures=failures)
    except ModelDirError as e:
        raise SystemExit(f"evaluate {name}: {e}") from None
    headline, details, rows = reports(name, scores, benches, failures if "tool_call" in scores else None)
    print(f"evaluate {name}: {headline}", file=sys.stderr)
    stage = paths.eval_reports(name)
    write_reports(stage, headline, details)
    atomic_write_text(paths.plot_file(stage), rows)


if __name__ == "__main__":
    main()
