"""The verifiable tasks: how a chat model's reply is read and checked. One home, used by the evaluate stage
(scores) and the rl stage (rewards), so a reward is exactly what the evaluation counts as right.

- `reply_text`: the part of a generated reply after its last calculator output (what the model itself
  concluded), special tokens dropped;
- `is_correct(task, reply, gold)`: arithmetic, word problems, letter counting: the number after '####',
  else the last number (`benchmarks.final_answer`); spelling: the exact spelling; largest of four: the
  letter standing alone in the reply (`benchmarks.chosen_letter`); gsm8k: the final number, compared as
  numbers (`benchmarks.same_number`).
"""
from __future__ import annotations

from .benchmarks import chosen_letter, final_answer, same_number

GENERATIVE = ("arithmetic", "word_problem", "letter_count", "spelling")
MULTIPLE_CHOICE = ("largest",)
SYNTHETIC = GENERATIVE + MULTIPLE_CHOICE  # pipeline/synthetic.py EVAL_TASKS, held out in artifacts/data/eval
CHECKED = SYNTHETIC + ("gsm8k",)  # every task `is_correct` checks


def is_correct(task: str, reply: str, gold: str) -> bool:
    """Whether `reply` (a chat model's reply as text, `reply_text`) answers an item of `task` whose answer is
    `gold`."""
    if task == "spelling":
        return reply.strip().rstrip(".").lower() == gold.lower()
    if task == "largest":
        return chosen_letter(reply, 4) == gold
    if task == "gsm8k":
        return same_number(final_answer(reply), gold)
    if task not in CHECKED:
        raise ValueError(f"no checker for task '{task}' (tasks: {', '.join(CHECKED)})")
    return final_answer(reply) == gold


def reply_text(tok, ids: list[int]) -> str:
    """A generated reply as text: the part after its last tool output, without special tokens."""
    end = tok.special["<|output_end|>"]
    tail = ids[len(ids) - ids[::-1].index(end):] if end in ids else ids
    special = set(tok.special.values())
    return tok.decode([t for t in tail if t not in special])
