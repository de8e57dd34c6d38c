"""Structured outputs: the request fields that constrain a reply, and the grammar each one gives.

  - chat completions' `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any
    JSON object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
  - the Responses API's `text.format`: the same three, the json_schema one flat ({"type": "json_schema",
    "name", "schema", "strict"});
  - completions' `guided_regex`, `guided_choice` and `guided_json` (vLLM's extension names; one at most).

Each becomes a grammar (model.grammar) that the engine's sampler enforces token by token, so the reply is
valid JSON for the schema (unless max_tokens or the context cut it first: finish_reason "length").
`strict: false` ignores schema keywords the grammar library does not implement instead of refusing them.
A schema that does not compile, or one past the bounds (model.grammar.MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH),
is a 400 naming the field.
"""
from __future__ import annotations

from model.grammar import GrammarError, choice_grammar, json_grammar, regex_grammar

from .errors import APIError
from .schemas import JSONSchemaFormat

def _compiled(runtime, grammar: str, param: str, what: str) -> str:
    try:
        runtime.grammars.check(grammar)
    except GrammarError as e:
        raise APIError(400, f"Invalid {what} for '{param}': {e}", param, "invalid_value") from None
    return grammar


def format_grammar(fmt, runtime, param: str) -> str | None:
    """The grammar of a response_format / text.format (None: plain text), checked against the model's
    tokenizer; a bad schema is a 400 naming `param`."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_grammar(None)
    spec = fmt.json_schema if isinstance(fmt, JSONSchemaFormat) else fmt
    try:
        grammar = json_grammar(spec.schema_, strict=bool(spec.strict))
    except GrammarError as e:
        raise APIError(400, f"Invalid schema for '{param}' ({spec.name}): {e}", param, "invalid_value") from None
    return _compiled(runtime, grammar, param, f"schema ({spec.name})")


def guided_grammar(req, runtime) -> str | None:
    """The grammar of a completions request's guided_* field (at most one)."""
    given = [k for k in ("guided_regex", "guided_choice", "guided_json") if getattr(req, k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"Set one of guided_regex, guided_choice and guided_json, not {' and '.join(given)}",
                       given[1], "invalid_value")
    param = given[0]
    try:
        if param == "guided_regex":
            grammar = regex_grammar(req.guided_regex)
        elif param == "guided_choice":
            grammar = choice_grammar(req.guided_choice)
        else:
            grammar = json_grammar(req.guided_json)
    except GrammarError as e:
        raise APIError(400, f"Invalid value for '{param}': {e}", param, "invalid_value") from None
    return _compiled(runtime, grammar, param, "value")
