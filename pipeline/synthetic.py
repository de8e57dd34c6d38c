"""Seeded generator of chat data and eval items, written for sparkchat (no outside data).

Tasks, each a function `(rng) -> item` where an item has the user `prompt`, the assistant `parts`
(text, calculator calls and their outputs) and, for evals, the gold `answer`:

- arithmetic    "What is 37 + 58?"   -> calculator call, then the answer in words
- word_problem  GSM8K-style one-step stories with a calculator call and a final "#### N" line
- letter_count  "How many 'r' in 'strawberry'?" -> calculator call 'strawberry'.count('r')
- spelling      "Spell 'house'." -> "h-o-u-s-e"
- largest (mc)  "Which number is the largest? A) .. D) .." -> a letter (multiple choice, chance 25%)
- capital       country -> capital facts
- identity      who the assistant is

Every training item is a conversation of its own, and a share of them come again inside conversations
of two or three exchanges (`conversations`). Held-out eval items come from their own seed and
`dedupe_against` removes every training item whose prompt equals an eval prompt, so no eval item is
ever trained on.
"""
from __future__ import annotations

import random
from typing import Callable

from model.calculator import calculate

WORDS = """apple house river stone light night music water green black white table chair dream
garden window summer winter autumn spring bread honey sugar paper pencil letter number planet
mountain forest island ocean castle bridge flower orange yellow purple silver golden thunder
rabbit turtle monkey tiger horse sheep goat eagle falcon spider dragon wizard king queen knight
sword shield crown candle mirror ladder basket bottle pocket jacket button rocket engine wheel
train plane cloud storm shadow voice heart smile laugh story poem song dance friend family
teacher doctor farmer sailor baker hunter painter writer market school church tower village city
country valley desert meadow butter cheese pepper tomato potato carrot lemon cherry banana grape
melon peach plum olive coffee cotton velvet marble copper iron glass brick cabin tent lamp clock
""".split()

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Chile": "Santiago", "Russia": "Moscow", "Poland": "Warsaw", "Greece": "Athens",
    "Turkey": "Ankara", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest",
    "Australia": "Canberra", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Cuba": "Havana",
    "Nigeria": "Abuja", "Ghana": "Accra", "Morocco": "Rabat", "Iran": "Tehran", "Iraq": "Baghdad",
    "Belgium": "Brussels", "Netherlands": "Amsterdam", "Switzerland": "Bern", "Czechia": "Prague",
}

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kira", "Leo",
         "Maya", "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wen", "Yusuf"]
ITEMS = ["apples", "books", "marbles", "stickers", "coins", "pencils", "cookies", "stamps", "shells", "cards"]

IDENTITY = [
    ("Who are you?", "I am sparkchat, a small language model trained from scratch with the sparkchat pipeline."),
    ("What is your name?", "My name is sparkchat."),
    ("Who made you?", "I was trained with sparkchat, an open pipeline for training chat models on your own hardware."),
    ("Are you a human?", "No, I am sparkchat, a small language model."),
    ("What can you do?", "I can chat, do arithmetic with a calculator, count letters and answer simple questions."),
    ("Hello!", "Hello! I am sparkchat. How can I help you?"),
    ("Hi", "Hi! What would you like to talk about?"),
    ("Thank you!", "You are welcome!"),
]


MULTI_TURNS = (2, 3)  # exchanges in a multi-turn conversation: three short ones fill the default 128-token context


def _user_assistant(prompt: str, parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": parts}]


def arithmetic(rng: random.Random) -> dict:
    op = rng.choice("+-*/")
    if op == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
    elif op == "/":
        b = rng.randint(2, 30)
        a = b * rng.randint(2, 40)
    else:
        a, b = rng.randint(1, 999), rng.randint(1, 999)
    expr = f"{a} {op} {b}"
    value = calculate(expr)
    word = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}[op]
    prompt = rng.choice([f"What is {expr}?", f"Compute {expr}.", f"{expr} = ?", f"What is {a} {word} {b}?",
                         f"Calculate {a} {word} {b}.", f"Please work out {expr}."])
    parts = [{"type": "python", "text": expr}, {"type": "python_output", "text": value},
             {"type": "text", "text": f"{expr} = {value}"}]
    return {"task": "arithmetic", "prompt": prompt, "parts": parts, "answer": value}


def word_problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 90), rng.randint(2, 90)
    kind = rng.randrange(3)
    if kind == 0:
        story = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        expr = f"{a} + {b}"
    elif kind == 1:
        a = a + b
        story = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        expr = f"{a} - {b}"
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        story = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} is that in total?"
        expr = f"{a} * {b}"
    value = calculate(expr)
    parts = [{"type": "text", "text": "We need "}, {"type": "python", "text": expr},
             {"type": "python_output", "text": value},
             {"type": "text", "text": f"{expr} = {value}.\n#### {value}"}]
    return {"task": "word_problem", "prompt": story, "parts": parts, "answer": value}


def letter_count(rng: random.Random) -> dict:
    word = rng.choice(WORDS)
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    expr = f"'{word}'.count('{letter}')"
    value = calculate(expr)
    prompt = rng.choice([f"How many times does the letter '{letter}' appear in '{word}'?",
                         f"Count the letter '{letter}' in the word '{word}'.",
                         f"How many '{letter}' are in '{word}'?"])
    parts = [{"type": "python", "text": expr}, {"type": "python_output", "text": value},
             {"type": "text", "text": f"The letter '{letter}' appears {value} times in '{word}'."}]
    return {"task": "letter_count", "prompt": prompt, "parts": parts, "answer": value}


def spelling(rng: random.Random) -> dict:
    word = rng.choice(WORDS)
    spelled = "-".join(word)
    prompt = rng.choice([f"Spell the word '{word}'.", f"How do you spell '{word}'?",
                         f"Spell '{word}' letter by letter."])
    return {"task": "spelling", "prompt": prompt, "parts": [{"type": "text", "text": spelled}], "answer": spelled}


def largest(rng: random.Random) -> dict:
    nums = rng.sample(range(1, 100), 4)
    letters = "ABCD"
    choices = " ".join(f"{letters[i]}) {n}" for i, n in enumerate(nums))
    answer = letters[nums.index(max(nums))]
    prompt = f"Which number is the largest? {choices}\nAnswer with the letter."
    return {"task": "largest", "prompt": prompt, "parts": [{"type": "text", "text": answer}], "answer": answer,
            "choices": list(letters)}


def capital(rng: random.Random) -> dict:
    country = rng.choice(list(CAPITALS))
    city = CAPITALS[country]
    prompt = rng.choice([f"What is the capital of {country}?", f"Name the capital city of {country}.",
                         f"Which city is the capital of {country}?"])
    return {"task": "capital", "prompt": prompt,
            "parts": [{"type": "text", "text": f"The capital of {country} is {city}."}], "answer": city}


def identity(rng: random.Random) -> dict:
    q, a = rng.choice(IDENTITY)
    return {"task": "identity", "prompt": q, "parts": [{"type": "text", "text": a}], "answer": a}


TRAIN_MIX: dict[str, tuple[Callable, float]] = {
    "arithmetic": (arithmetic, 0.30), "word_problem": (word_problem, 0.20), "letter_count": (letter_count, 0.15),
    "spelling": (spelling, 0.10), "largest": (largest, 0.13), "capital": (capital, 0.07),
    "identity": (identity, 0.05),
}
EVAL_TASKS = ("arithmetic", "word_problem", "letter_count", "spelling", "largest")


def to_messages(item: dict) -> list[dict]:
    return _user_assistant(item["prompt"], item["parts"])


def conversations(items: list[dict], multi_turn: float, seed: int) -> list[list[dict]]:
    """Every item as a conversation of its own (as the evals ask it), and `multi_turn` x len(items) of
    them once more, in conversations of MULTI_TURNS exchanges: there the model learns to answer the
    last question with the earlier exchanges (their calculator calls and results as written) in its
    context, which is how a chat front end prompts it."""
    rng = random.Random(seed)
    out = [to_messages(it) for it in items]
    again = rng.sample(items, round(len(items) * multi_turn))
    i = 0
    while i < len(again):
        n = rng.randint(*MULTI_TURNS)
        out.append([m for it in again[i:i + n] for m in to_messages(it)])
        i += n
    return out


def generate_train(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    names = list(TRAIN_MIX)
    weights = [TRAIN_MIX[k][1] for k in names]
    return [TRAIN_MIX[rng.choices(names, weights)[0]][0](rng) for _ in range(n)]


def generate_eval(n_per_task: int, seed: int) -> dict[str, list[dict]]:
    """Distinct held-out items per task (distinct prompts), from a seed of their own: the first `n_per_task`
    distinct prompts of 50 x `n_per_task` draws, but never more than half of the distinct prompts those draws
    found, so a task with a small pool (spelling: 387 prompts) leaves training half of it."""
    out = {}
    for i, task in enumerate(EVAL_TASKS):
        rng = random.Random(seed * 1000 + i)
        seen, items = set(), []
        for _ in range(n_per_task * 50):
            it = TRAIN_MIX[task][0](rng)
            if it["prompt"] not in seen:
                seen.add(it["prompt"])
                items.append(it)
        out[task] = items[:min(n_per_task, len(seen) // 2)]
    return out


def normalize_prompt(text: str) -> str:
    return " ".join(text.lower().split())


def dedupe_against(train: list[dict], held_out_prompts: set[str]) -> list[dict]:
    return [it for it in train if normalize_prompt(it["prompt"]) not in held_out_prompts]
