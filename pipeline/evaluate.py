"""Stage `evaluate`: how good are the base, midtrained and SFT models, on items none of them trained on.

- base val bits per byte (pretraining text), for every model;
- generative tasks, greedy, with the calculator tool if the model's generation.json allows it:
  arithmetic, word problems (GSM8K-style, the number after '####' or the last number), letter
  counting, spelling (exact answer); chance ~0;
- multiple choice (largest of four numbers): the letter with the highest logit after the prompt;
  chance 25%;
- optional real benchmarks through `datasets` (evaluate.extra): MMLU and ARC as multiple choice,
  GSM8K as exact-answer math.

Writes its metrics and a scores plot where `sparkchat.paths` says (DVC metrics and plots).
"""
from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import torch
from tqdm import tqdm

from model.chat import render
from model.chat_engine import chat_engine
from model.engine import Engine, SamplingParams, Token
from model.loss_eval import evaluate_bpb, token_bytes
from model.model_dir import ModelDirError, load_model_dir

from sparkchat import paths

from .config import Params, load_params
from .data import TokenStream, open_tokens
from .metrics import atomic_write_text, write_json
from .sources import open_dataset
from .runtime import resolve_device

GENERATIVE = ("arithmetic", "word_problem", "letter_count", "spelling")
MULTIPLE_CHOICE = ("largest",)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The model's answer: after '####' if present, else the last number, else the stripped text."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    nums = NUMBER.findall(text.replace(",", ""))
    return nums[-1] if nums else text.strip()


def is_correct(task: str, reply: str, gold: str) -> bool:
    if task == "spelling":
        return reply.strip().rstrip(".").lower() == gold.lower()
    return final_answer(reply) == gold


def generate_all(engine: Engine, tok, prompts: list[list[int]], max_new: int, desc: str) -> list[str]:
    """Submit every prompt at once; the engine batches them. Returns the replies as text (the part
    after the last tool output, which is what the model itself concluded)."""
    out: list[list[int]] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    for i, ids in enumerate(prompts):
        def sink(ev, i=i):
            if isinstance(ev, Token):
                out[i].append(ev.id)
            else:
                done.release()
        engine.submit(ids, params, sink)
    for _ in tqdm(prompts, desc=desc, file=sys.stderr, mininterval=2.0, leave=False):
        done.acquire()
    end = tok.special["<|output_end|>"]
    replies = []
    for ids in out:
        tail = ids[len(ids) - ids[::-1].index(end):] if end in ids else ids
        replies.append(tok.decode([t for t in tail if t not in tok.special.values()]))
    return replies


@torch.no_grad()
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


def extra_items(spec: str, n: int) -> tuple[str, list[dict]]:
    """evaluate.extra entry -> (kind, items). mmlu/arc rows become letter multiple choice; gsm8k rows
    exact-answer math."""
    kind, source = spec.split(":", 1)
    ds = open_dataset(source, "test")
    items = []
    for i, row in enumerate(ds):
        if i >= n:
            break
        if kind == "gsm8k":
            items.append({"prompt": row["question"], "answer": final_answer(str(row["answer"]))})
            continue
        if kind == "mmlu":
            texts, gold = list(row["choices"]), "ABCDEFGH"[int(row["answer"])]
            labels = list("ABCDEFGH"[:len(texts)])
        else:  # arc
            texts, labels, gold = list(row["choices"]["text"]), list(row["choices"]["label"]), str(row["answerKey"])
        options = " ".join(f"{l}) {t}" for l, t in zip(labels, texts))
        items.append({"prompt": f"{row['question']} {options}\nAnswer with the letter.", "answer": gold,
                      "choices": labels})
    return kind, items


def evaluate_model(name: str, path: Path, p: Params, device) -> dict:
    model, tok, gen = load_model_dir(path, device=device)
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
        for spec in p.evaluate.extra:
            kind, items = extra_items(spec, p.evaluate.max_items)
            key = spec.replace(":", "_").replace("/", "_")
            if kind == "gsm8k":
                prompts = [render(tok, [{"role": "user", "content": it["prompt"]}], for_completion=True)[0][-seq_len // 2:]
                           for it in items]
                replies = generate_all(engine, tok, prompts, p.evaluate.max_new_tokens, f"{name}/{key}")
                scores[key] = round(sum(final_answer(r) == it["answer"] for r, it in zip(replies, items)) / len(items), 4)
            else:
                scores[key] = round(multiple_choice(model, tok, items, device), 4)
    finally:
        engine.shutdown()
    return scores


def main(argv=None) -> None:
    p = load_params(stage="evaluate")
    device = resolve_device(p.runtime.device)
    results = {}
    for name, path in paths.EVAL_MODELS.items():
        try:
            results[name] = evaluate_model(name, path, p, device)
        except ModelDirError as e:
            raise SystemExit(f"evaluate: {e}") from None
        print(f"evaluate {name}: {results[name]}", file=sys.stderr)
    results["chance"] = {"largest": 0.25, **{t: 0.0 for t in GENERATIVE}}
    write_json(paths.metrics_file("evaluate"), results)
    rows = ["model\ttask\taccuracy"] + [f"{m}\t{t}\t{v}" for m, sc in results.items() for t, v in sc.items()
                                         if t != "val_bpb"]
    atomic_write_text(paths.plot_file("evaluate"), "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
