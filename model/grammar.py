"""Constrained decoding: a grammar per request, turned into a mask of the ids its next token may be.

Structured outputs (a reply that is JSON, or valid against a JSON schema) and forced tool calls (a call
of a given function with valid arguments) are one mechanism: the request carries a grammar (a string,
in `SamplingParams.grammar`), and before each of its tokens the engine sets the logits of every id the
grammar does not allow next to -inf (`mask_rows`), then samples as usual. Rows without a grammar are not
touched.

The grammar library is llguidance (Microsoft's, Rust with Python bindings, no dependencies). Of the three
on PyPI we measured on our own tokenizer (bench/results/serving.md, "Grammar libraries"), it compiles a
schema fastest (a request pays that once), and its grammars name special tokens by id (`<[id]>`), which a
tool call's delimiters need: a grammar over token bytes would let a model spell "<|call_start|>" out of
plain characters. xgrammar computes a mask several times faster a token; at our models' step times both
are a small part of a step.

Bounds: a schema is refused (`GrammarError`, a ValueError naming what is wrong) above MAX_SCHEMA_CHARS
characters of JSON or MAX_SCHEMA_DEPTH levels of nesting, and llguidance's own parser limits bound the
work a token's mask may take.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance
import numpy as np

if TYPE_CHECKING:
    import torch

MAX_SCHEMA_CHARS = 16384
"""The longest schema (as compact JSON) a request may send."""
MAX_SCHEMA_DEPTH = 16
"""The deepest nesting of objects and arrays a schema may have."""
# compact JSON: the default model's context is 128 tokens, and a space is a token
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    pass


def _depth(value, level: int = 0) -> int:
    if isinstance(value, dict):
        return max([_depth(v, level + 1) for v in value.values()], default=level + 1)
    if isinstance(value, list):
        return max([_depth(v, level + 1) for v in value], default=level + 1)
    return level


def check_schema(schema, what: str = "schema") -> str:
    """`schema` as compact JSON, or a GrammarError if it is not an object or is past the bounds."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{what} is {len(text)} characters of JSON; at most {MAX_SCHEMA_CHARS} are allowed")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return text


def json_grammar(schema: dict | None = None, strict: bool = True) -> str:
    """A grammar for one JSON value valid against `schema` (None: any JSON object, OpenAI's json_object).
    Not strict: keywords llguidance does not implement (a `format` it does not know) are ignored instead of
    refused."""
    schema = {"type": "object"} if schema is None else schema
    return llguidance.LLMatcher.grammar_from_json_schema(check_schema(schema),
                                                         defaults={**JSON_STYLE, "lenient": not strict})


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of these strings."""
    return "start: " + " | ".join(json.dumps(c) for c in choices) + "\n"


def tool_call_grammar(call_start: int, call_end: int, functions: list[tuple[str, dict]], many: bool) -> str:
    """Calls (one, or `many`: one or more) of these (name, parameters schema) functions, each
    call_start {"name": ..., "arguments": {...}} call_end: the form model.tools renders a call in."""
    # arguments hold only the declared parameters unless a schema says otherwise (JSON Schema's default
    # admits any other key, and a model that wrote one would never be done)
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"additionalProperties": False,
                                                                                      **params}},
              "required": ["name", "arguments"], "additionalProperties": False} for name, params in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body = check_schema({**schema, "x-guidance": {**JSON_STYLE, "lenient": True}}, "tools")
    return f"start: call{'+' if many else ''}\ncall: <[{call_start}]> %json {body} <[{call_end}]>\n"


class Constraint:
    """One request's grammar as it advances: the mask of its next token, and the tokens it took."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch as lt  # (here: a server's front end checks grammars without loading torch)
        lt.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token: int) -> bool:
        """Take the token; False if the grammar did not allow it."""
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class Grammars:
    """Grammars over one tokenizer (its tokenizer.json text), for a model of `vocab_size` ids (ids past the
    tokenizer's are never allowed); `eos` is the id that ends a reply, allowed once the grammar is complete."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def check(self, grammar: str) -> None:
        """GrammarError with llguidance's message if `grammar` does not compile."""
        if not isinstance(grammar, str):
            raise GrammarError(f"a grammar is a string, got {type(grammar).__name__}")
        ok, message = self._validate(grammar)
        if not ok:
            raise GrammarError(message)

    def _validate(self, grammar: str) -> tuple[bool, str]:
        try:
            message = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        except Exception as e:  # malformed grammar JSON
            return False, str(e)
        return not message, message

    def __call__(self, grammar: str) -> Constraint:
        """A fresh Constraint for `grammar` (GrammarError if it does not compile)."""
        self.check(grammar)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher)


def _forbidden(constrained: list[tuple[int, Constraint]], V: int, device) -> torch.Tensor:
    """(len(constrained), V) bool on `device`: the ids each constraint forbids next."""
    import torch  # (here, not above: a server's front end checks grammars without loading torch)
    bitmask = torch.full((len(constrained), (V + 31) // 32), -1, dtype=torch.int32)
    for j, (_, c) in enumerate(constrained):
        c.fill(bitmask, j)
    # bit i of word w is id 32 w + i: as bytes of a little-endian int32, bits in little order. Unpacked
    # here, not by llguidance.torch's apply (a torch.compile'd kernel: seconds of compiling at a server's
    # first constrained request, and again for new shapes)
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
    return torch.from_numpy(allowed == 0).to(device, non_blocking=True)


def mask_rows(logits: torch.Tensor, constrained: list[tuple[int, Constraint]]) -> None:
    """Set to -inf, in place, the logits (B, V) of every id that each (row, constraint) forbids next."""
    if not constrained:
        return
    forbidden = _forbidden(constrained, logits.shape[-1], logits.device)
    for j, (row, _) in enumerate(constrained):
        logits[row].masked_fill_(forbidden[j], float("-inf"))


def write_masks(mask: torch.Tensor, constrained: list[tuple[int, Constraint]]) -> None:
    """Each (row, constraint)'s next-token mask into its row of `mask` (rows, V): -inf where forbidden, else
    0, added to the logits by the sampler (`model.sampling.extras_step`, inside a CUDA graph)."""
    if not constrained:
        return
    forbidden = _forbidden(constrained, mask.shape[-1], mask.device)
    for j, (row, _) in enumerate(constrained):
        mask[row].zero_().masked_fill_(forbidden[j], float("-inf"))
