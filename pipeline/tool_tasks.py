"""The seeded synthetic tool-use task: made-up functions with typed arguments, conversations where the
right one is called, its result comes back and is used, and conversations where none fits.

Each item offers two of FUNCTIONS (model/tools.py renders them as compact signatures: the default
model's context is 128 tokens). A `call` item's user asks for something one of them does: the assistant
calls it (`call_text`), the tool's result comes back (a `tool` message) and the assistant answers with
it. A `none` item's user asks something else (a capital, a greeting): the assistant answers without a
call. Conversations are stored as {"messages", "tools"} (pipeline/tokenize.py renders both).

`score(items, replies)` is the evaluate stage's tool-use score on held-out items: `tool_call`, the share
of call items whose reply calls the right function with arguments valid against its schema and equal to
the gold ones; `tool_none`, the share of none items whose reply makes no call. `failures` says how the
others failed (no call, the wrong function, invalid or wrong arguments, ...), per function.
"""
from __future__ import annotations

import random

import jsonschema

from model.tools import call_text, parse_call

from .synthetic import CAPITALS, IDENTITY, NAMES, WORDS

CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Berlin", "Madrid", "Dublin", "Vienna", "Athens",
          "Hanoi", "Accra", "Bern", "Prague", "Warsaw", "Havana", "Lisbon", "Moscow", "Bangkok"]
LANGS = {"fr": "French", "es": "Spanish", "de": "German"}


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props), "additionalProperties": False}


FUNCTIONS = {
    "get_weather": _obj({"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}),
    "set_timer": _obj({"minutes": {"type": "integer", "minimum": 1, "maximum": 120}}),
    "translate": _obj({"word": {"type": "string"}, "lang": {"enum": list(LANGS)}}),
    "send_email": _obj({"to": {"type": "string"}, "subject": {"type": "string"}}),
    "get_price": _obj({"item": {"type": "string"}}),
}
CALL_SHARE = 0.6  # of the items, those where a tool fits


def _request(name: str, rng: random.Random) -> tuple[str, dict, str, str]:
    """(user prompt, arguments, the tool's result, the assistant's answer) for a call of `name`."""
    if name == "get_weather":
        city, unit = rng.choice(CITIES), rng.choice("cf")
        deg = rng.randint(-5, 35) if unit == "c" else rng.randint(25, 95)
        prompt = rng.choice([f"What is the weather in {city} in {'celsius' if unit == 'c' else 'fahrenheit'}?",
                             f"How warm is it in {city}? Use {'celsius' if unit == 'c' else 'fahrenheit'}."])
        return prompt, {"city": city, "unit": unit}, str(deg), f"It is {deg} {unit.upper()} in {city}."
    if name == "set_timer":
        m = rng.randint(1, 120)
        return (rng.choice([f"Set a timer for {m} minutes.", f"Start a {m} minute timer."]), {"minutes": m},
                "ok", f"Timer set for {m} minutes.")
    if name == "translate":
        word, lang = rng.choice(WORDS), rng.choice(list(LANGS))
        return (rng.choice([f"Translate '{word}' into {LANGS[lang]}.", f"How do you say '{word}' in {LANGS[lang]}?"]),
                {"word": word, "lang": lang}, word[::-1], f"It is '{word[::-1]}'.")
    if name == "send_email":
        to, subject = rng.choice(NAMES), rng.choice(WORDS)
        return (rng.choice([f"Email {to} about the {subject}.", f"Send {to} an email with the subject {subject}."]),
                {"to": to, "subject": subject}, "sent", f"Sent to {to}.")
    item = rng.choice(WORDS)
    price = rng.randint(1, 99)
    return (rng.choice([f"How much does a {item} cost?", f"What is the price of a {item}?"]), {"item": item},
            str(price), f"A {item} costs {price} dollars.")


def _plain(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.6:
        country = rng.choice(list(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    return rng.choice(IDENTITY)


def tool_item(rng: random.Random) -> dict:
    """One item: {"tools": [{"name", "parameters"}], "prompt", "call": {"name", "arguments"} | None,
    "result", "answer"}."""
    offered = rng.sample(sorted(FUNCTIONS), 2)
    tools = [{"name": n, "parameters": FUNCTIONS[n]} for n in offered]
    if rng.random() < CALL_SHARE:
        name = rng.choice(offered)
        prompt, args, result, answer = _request(name, rng)
        return {"task": "tool_use", "tools": tools, "prompt": prompt, "call": {"name": name, "arguments": args},
                "result": result, "answer": answer}
    prompt, answer = _plain(rng)
    return {"task": "tool_use", "tools": tools, "prompt": prompt, "call": None, "result": None, "answer": answer}


def conversation(item: dict) -> dict:
    """The item as a training conversation ({"messages", "tools"})."""
    user = {"role": "user", "content": item["prompt"]}
    if item["call"] is None:
        return {"tools": item["tools"], "messages": [user, {"role": "assistant", "content": item["answer"]}]}
    call = [{"type": "call", "text": call_text(item["call"]["name"], item["call"]["arguments"])}]
    return {"tools": item["tools"], "messages": [user, {"role": "assistant", "content": call},
                                                 {"role": "tool", "content": item["result"]},
                                                 {"role": "assistant", "content": item["answer"]}]}


def generate(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [tool_item(rng) for _ in range(n)]


def key(item: dict) -> tuple:
    """What makes an item distinct: its prompt and the functions offered (a question where no tool fits
    comes from a small pool of questions; offered beside other functions it is another item)."""
    return item["prompt"], tuple(f["name"] for f in item["tools"])


def generate_eval(n: int, seed: int) -> list[dict]:
    """`n` held-out items with distinct keys, from a seed of their own (training drops items with their keys)."""
    rng, seen, out = random.Random(seed), set(), []
    for _ in range(n * 50):
        it = tool_item(rng)
        if key(it) not in seen:
            seen.add(key(it))
            out.append(it)
        if len(out) == n:
            break
    return out


FAILURES = ("no_call", "many_calls", "not_a_call", "wrong_function", "invalid_arguments", "wrong_arguments",
            "called_when_none_fits")  # outcome()'s kinds of failure, in the order it checks them


def outcome(item: dict, calls: list[str]) -> str:
    """What a reply (its call texts) did with an item: "right", or the first of FAILURES it fell into."""
    if item["call"] is None:
        return "called_when_none_fits" if calls else "right"
    if not calls:
        return "no_call"
    if len(calls) != 1:
        return "many_calls"
    if (call := parse_call(calls[0])) is None:
        return "not_a_call"
    name, args = call
    if name != item["call"]["name"]:
        return "wrong_function"
    try:
        jsonschema.validate(args, FUNCTIONS[name])
    except jsonschema.ValidationError:
        return "invalid_arguments"
    return "right" if args == item["call"]["arguments"] else "wrong_arguments"


def right_call(item: dict, calls: list[str]) -> bool:
    """The reply's calls (their texts) are one call of the gold function, its arguments valid and the gold ones."""
    return item["call"] is not None and outcome(item, calls) == "right"


def score(items: list[dict], replies: list[list[str]]) -> dict[str, float]:
    """tool_call and tool_none over the items, given each reply's call texts."""
    calls = [right_call(it, r) for it, r in zip(items, replies) if it["call"] is not None]
    nones = [not r for it, r in zip(items, replies) if it["call"] is None]
    return {"tool_call": round(sum(calls) / max(1, len(calls)), 4), "tool_none": round(sum(nones) / max(1, len(nones)), 4)}


def failures(items: list[dict], replies: list[list[str]]) -> dict[str, dict[str, int]]:
    """How the replies failed, per gold function ("none": the items where none fits): {function: {kind: count}},
    the kinds of FAILURES that occurred; what the evaluate stage records beside the score."""
    out: dict[str, dict[str, int]] = {}
    for it, r in zip(items, replies):
        kind = outcome(it, r)
        if kind != "right":
            per = out.setdefault(it["call"]["name"] if it["call"] else "none", {})
            per[kind] = per.get(kind, 0) + 1
    return out
