"""The field's benchmarks, read through `datasets` in their own schemas, and how each is put to a model.

| task | schema (the hub dataset's own fields) | split | base model (log-likelihood) | chat model (generation) |
| --- | --- | --- | --- | --- |
| arc_easy, arc_challenge | id, question, choices {text, label}, answerKey | test | "Question: ...\\nAnswer:" + each choice's text | the letter |
| mmlu | question, subject, choices [4], answer (0-3) | test | question, "A. ..." lines, "Answer:" + each letter | the letter |
| hellaswag | activity_label, ctx_a, ctx_b, endings [4], label ("0"-"3") | validation | the scene + each ending | the letter |
| lambada | text | test | the passage + its last word, greedy | - |
| gsm8k | question, answer ("... #### N") | test | - | the number |

A multiple-choice item is scored the way nanochat's CORE scores it: the choice whose continuation has
the highest log-likelihood per token wins. The base-model prompts are lm-evaluation-harness's (ARC and
HellaSwag cloze-style, HellaSwag's text cleaned as the harness cleans it, MMLU with lettered choices);
a chat model sees the question with its choices as "A) ... B) ..." and answers with a letter, the
format the synthetic multiple-choice task teaches. Few-shot examples are other items of the same split,
drawn with a seed per item, as CORE draws them.

Chance: the mean over the items scored of 1 / number of choices (ARC has 3-5 choices); 0 for LAMBADA
and GSM8K.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

LETTERS = "ABCDEFGHIJ"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class BenchmarkError(ValueError):
    pass


@dataclass(frozen=True)
class Item:
    context: str
    """Base models: the text before the answer."""
    choices: tuple[str, ...]
    """Base models: the candidate continuations (after a space); one for a language-modelling item."""
    gold: int
    """Index of the right choice."""
    prompt: str = ""
    """Chat models: the user's message."""
    reply: str = ""
    """Chat models: a right reply in full (shown in few-shot turns)."""
    answer: str = ""
    """Chat models: what is extracted from a right reply (a letter, or GSM8K's number)."""


def final_answer(text: str) -> str:
    """A reply's answer: after '####' if present, else the last number, else the stripped text."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    nums = NUMBER.findall(text.replace(",", ""))
    return nums[-1] if nums else text.strip()


def same_number(got: str, want: str) -> bool:
    """GSM8K's comparison: as numbers when both are ("7.50" is "7.5"), else as text."""
    try:
        return float(got) == float(want)
    except ValueError:
        return got == want


def chosen_letter(reply: str, n_choices: int) -> str:
    """The first of the choices' letters standing alone in a reply ('' if none): "B", "B) the Sun", "(B)",
    "The answer is B." all give B; a capital that starts a word or a sentence ("A chat...") gives nothing."""
    m = re.search(rf"\b([{LETTERS[:n_choices]}])\b(?! [a-z])", reply)
    return m.group(1) if m else ""


def _lettered(question: str, options: list[str], gold: int) -> dict:
    letters = LETTERS[:len(options)]
    shown = " ".join(f"{letter}) {text}" for letter, text in zip(letters, options))
    return {"prompt": f"{question} {shown}\nAnswer with the letter.", "reply": letters[gold], "answer": letters[gold]}


def arc(row: dict) -> Item:
    texts, labels = list(row["choices"]["text"]), list(row["choices"]["label"])
    if row["answerKey"] not in labels:
        raise BenchmarkError(f"answerKey '{row['answerKey']}' is not one of the labels {labels}")
    gold = labels.index(row["answerKey"])
    return Item(f"Question: {row['question']}\nAnswer:", tuple(texts), gold, **_lettered(row["question"], texts, gold))


def mmlu(row: dict) -> Item:
    texts, gold = list(row["choices"]), int(row["answer"])
    lines = "".join(f"\n{letter}. {text}" for letter, text in zip(LETTERS, texts))
    return Item(f"{row['question'].strip()}{lines}\nAnswer:", tuple(LETTERS[:len(texts)]), gold,
                **_lettered(row["question"].strip(), texts, gold))


def _clean_hellaswag(text: str) -> str:
    # the WikiHow half of HellaSwag carries markup such as "[title]" and "[step]" (as the harness cleans it)
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag(row: dict) -> Item:
    scene = _clean_hellaswag(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}")
    endings, gold = [_clean_hellaswag(e) for e in row["endings"]], int(row["label"])
    return Item(scene, tuple(endings), gold, **_lettered(f"How does it go on? {scene} ...", endings, gold))


def lambada(row: dict) -> Item:
    context, _, word = row["text"].rpartition(" ")
    if not context:
        raise BenchmarkError(f"text {row['text'][:60]!r} has no last word to predict")
    return Item(context, (word,), 0)


def gsm8k(row: dict) -> Item:
    if "####" not in row["answer"]:
        raise BenchmarkError(f"answer {row['answer'][-60:]!r} has no '#### <number>'")
    return Item(row["question"], (), 0, prompt=row["question"], reply=row["answer"], answer=final_answer(row["answer"]))


@dataclass(frozen=True)
class Task:
    kind: str
    """'choice' (base and chat models), 'lm' (base models) or 'math' (chat models)."""
    split: str
    """The split read from a hub dataset (a local file is one split)."""
    fields: tuple[str, ...]
    """Columns the source must have (the dataset's own schema)."""
    item: Callable[[dict], Item]


# one entry per block of params.yaml `evaluate.benchmarks` (pipeline/config.py BenchmarksParams)
TASKS = {
    "arc_easy": Task("choice", "test", ("question", "choices", "answerKey"), arc),
    "arc_challenge": Task("choice", "test", ("question", "choices", "answerKey"), arc),
    "mmlu": Task("choice", "test", ("question", "choices", "answer"), mmlu),
    "hellaswag": Task("choice", "validation", ("activity_label", "ctx_a", "ctx_b", "endings", "label"), hellaswag),
    "lambada": Task("lm", "test", ("text",), lambada),
    "gsm8k": Task("math", "test", ("question", "answer"), gsm8k),
}
LOGLIKELIHOOD_KINDS = ("choice", "lm")
CHAT_KINDS = ("choice", "math")


@dataclass
class Benchmark:
    """One task's data: every item of the split (the few-shot pool), which of them are scored, and how
    many solved examples go before each."""
    name: str
    task: Task
    pool: list[Item]
    scored: list[int]
    shots: int = 0

    @property
    def chance(self) -> float:
        if self.task.kind != "choice":
            return 0.0
        return sum(1 / len(self.pool[i].choices) for i in self.scored) / len(self.scored)

    def examples(self, i: int) -> list[Item]:
        """`shots` other items of the pool, drawn with a seed of item i's own (CORE's few-shot draw)."""
        k = min(self.shots, len(self.pool) - 1)
        others = random.Random(1234 + i).sample(range(len(self.pool) - 1), k)
        return [self.pool[j + (j >= i)] for j in others]  # skip item i itself


def _rows(source: str, split: str):
    """The rows of a source, streamed: only the split's own files are read (MMLU's hub repository also
    holds a 100k-row auxiliary train split), and nothing is written to the `datasets` cache."""
    import datasets
    datasets.disable_progress_bars()
    if source.startswith("hub:"):
        ident, _, config = source.removeprefix("hub:").partition(":")
        return datasets.load_dataset(ident, config or None, split=split, streaming=True)
    kind = "parquet" if Path(source).suffix.lower() == ".parquet" else "json"
    return datasets.load_dataset(kind, data_files=source, split="train", streaming=True)


def load_benchmark(name: str, source: str, max_items: int, shots: int = 0, seed: int = 0,
                   split: str | None = None) -> Benchmark:
    """A task's items from `source` (hub:<id>[:<config>] or a local file): all of them scored when there
    are at most `max_items`, else a sample of `max_items` drawn with `seed`. `split`: the hub split read
    instead of the task's evaluation split (the rl stage trains on GSM8K's train split)."""
    task = TASKS[name]
    pool = []
    try:
        for n, row in enumerate(_rows(source, split or task.split)):
            missing = [f for f in task.fields if f not in row]
            if missing:
                raise BenchmarkError(f"row {n} has no field '{missing[0]}' (the task reads {', '.join(task.fields)}; "
                                     f"the row has {', '.join(row)})")
            try:
                pool.append(task.item(row))
            except (ValueError, TypeError, KeyError) as e:
                raise BenchmarkError(f"row {n}: {e}") from None
    except Exception as e:  # a bad row, or network, an unknown id, an unreadable file: name the task and source
        raise BenchmarkError(f"{name}: '{source}': {e}") from None
    if not pool:
        raise BenchmarkError(f"{name}: '{source}' has no rows")
    scored = sorted(random.Random(seed).sample(range(len(pool)), max_items)) if len(pool) > max_items \
        else list(range(len(pool)))
    return Benchmark(name, task, pool, scored, shots)
