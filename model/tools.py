"""Function calling as the model sees it: the client's tools, a call the model makes, and its result.

A conversation with tools renders (model.chat) as

    <|bos|> [system] <|tools_start|> get_weather(city:str,unit?:"c"|"f");add(a:int,b:int) <|tools_end|>
    <|user_start|> ... <|user_end|> <|assistant_start|>
    <|call_start|> {"name":"get_weather","arguments":{"city":"Paris"}} <|call_end|> <|assistant_end|>
    <|result_start|> {"temp":21} <|result_end|> <|assistant_start|> It is 21 degrees. <|assistant_end|>

Definitions are compact signatures, not their JSON schemas: the default model's whole context is 128
tokens. A call is compact JSON (`call_text`), the same form the grammar of a forced call produces
(model.grammar.tool_call_grammar). The client runs the tool, as OpenAI's API has it: the engine stops at
<|assistant_end|> after the calls and the result comes back in a `tool` message.
"""
from __future__ import annotations

import json

from .tokenizer import TOOL_TOKENS

_TYPES = {"string": "str", "integer": "int", "number": "num", "boolean": "bool", "array": "list",
          "object": "obj", "null": "null"}


def _type(schema: dict) -> str:
    if "enum" in schema:
        return "|".join(json.dumps(v, separators=(",", ":")) for v in schema["enum"])
    t = schema.get("type", "any")
    if isinstance(t, list):
        return "|".join(_TYPES.get(x, str(x)) for x in t)
    if t == "array" and isinstance(schema.get("items"), dict):
        return f"list[{_type(schema['items'])}]"
    return _TYPES.get(t, str(t))


def signature(name: str, parameters: dict | None) -> str:
    """`name(arg:type,optional?:type)` from a function's JSON-schema parameters."""
    props = (parameters or {}).get("properties") or {}
    required = set((parameters or {}).get("required") or [])
    args = [f"{k}{'' if k in required else '?'}:{_type(v if isinstance(v, dict) else {})}" for k, v in props.items()]
    return f"{name}({','.join(args)})"


def tools_text(functions: list[dict]) -> str:
    """The definitions' line: each function's signature, joined by ';'. functions: {"name", "parameters"}."""
    return ";".join(signature(f["name"], f.get("parameters")) for f in functions)


def call_text(name: str, arguments: dict) -> str:
    """A call as the model writes it between <|call_start|> and <|call_end|>."""
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"), ensure_ascii=False)


def parse_call(text: str) -> tuple[str, dict] | None:
    """(name, arguments) of a call the model wrote, or None if it is not one."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], call["arguments"]


def has_tools(tok) -> bool:
    """The tokenizer was trained with the function-calling tokens."""
    return all(t in tok.special for t in TOOL_TOKENS)
