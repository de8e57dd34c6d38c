"""Structured outputs through the real server with the official openai client: response_format
(json_object, json_schema strict and not, `parse` with a pydantic model), the Responses API's
text.format, completions' guided_* fields, and the 400s of bad schemas. The model is the session's tiny
random one: whatever it would write, the grammar makes the reply valid."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field


PROMPTS = ["Describe a person.", "Who lives in Verona?", "Give me a record.", "Hello!", "Make up a friend.",
           "A user, please.", "What is 12 + 30?", "Tell me about Juliet.", "Name someone.", "Any JSON."]


class Address(BaseModel):
    city: Annotated[str, Field(max_length=8)]
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Person(BaseModel):
    name: Annotated[str, Field(max_length=10)]
    age: Annotated[int, Field(ge=0, le=120)]
    color: Literal["red", "green", "blue"]
    address: Address


NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 6},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                             "ok": {"type": "boolean"}},
            "required": ["id", "ok"], "additionalProperties": False}},
        "meta": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"],
                 "additionalProperties": False},
    },
    "required": ["title", "items", "meta"],
    "additionalProperties": False,
}


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def test_parse_with_a_pydantic_model_20_of_20(serve_openai_client):
    parsed = [serve_openai_client.chat.completions.parse(model="sparkchat", messages=ask(i), response_format=Person,
                                            max_tokens=110, seed=i).choices[0].message.parsed for i in range(20)]
    assert all(isinstance(p, Person) for p in parsed)
    assert len({p.model_dump_json() for p in parsed}) > 1  # sampled, not one canned reply


def test_parse_streaming_20_of_20(serve_openai_client):
    for i in range(20):
        with serve_openai_client.chat.completions.stream(model="sparkchat", messages=ask(i), response_format=Person,
                                            max_tokens=110, seed=100 + i) as stream:
            deltas = [e for e in stream if e.type == "content.delta"]
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, Person)
        assert len(deltas) > 1  # it came in pieces


@pytest.mark.parametrize("strict", [True, False])
def test_nested_json_schema_20_of_20_valid(serve_openai_client, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": NESTED, "strict": strict}}
    for i in range(20):
        r = serve_openai_client.chat.completions.create(model="sparkchat", messages=ask(i), response_format=fmt,
                                           max_tokens=110, seed=i, temperature=1.0)
        jsonschema.validate(json.loads(r.choices[0].message.content), NESTED)
        assert r.choices[0].finish_reason == "stop"


def test_json_object_is_an_object(serve_openai_client):
    done = 0
    for i in range(5):
        r = serve_openai_client.chat.completions.create(model="sparkchat", messages=ask(i), max_tokens=110, seed=i,
                                           response_format={"type": "json_object"})
        assert r.choices[0].message.content.startswith("{")
        if r.choices[0].finish_reason == "stop":  # an unbounded object may run past max_tokens ("length")
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            done += 1
    assert done


def test_responses_text_format(serve_openai_client):
    fmt = {"type": "json_schema", "name": "report", "schema": NESTED, "strict": True}
    r = serve_openai_client.responses.create(model="sparkchat", input="A report, please.", text={"format": fmt},
                                max_output_tokens=110)
    jsonschema.validate(json.loads(r.output_text), NESTED)
    assert r.text.format.type == "json_schema"


def test_completions_guided_choice_and_regex(serve_openai_client):
    r = serve_openai_client.completions.create(model="sparkchat", prompt="The colour is", max_tokens=10, n=4, seed=1,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert {c.text for c in r.choices} <= {"red", "green", "blue"}
    r = serve_openai_client.completions.create(model="sparkchat", prompt="Call", max_tokens=12, seed=1,
                                  extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert r.choices[0].text[:3].isdigit() and r.choices[0].text[3] == "-" and len(r.choices[0].text) == 8


def test_unconstrained_rows_beside_a_constrained_one_are_unchanged(serve_model, serve_tokenizer):
    """A constrained request in the same batch changes nothing of the others' ids."""
    from model.chat_engine import chat_engine
    from model.grammar import json_grammar
    from model.requests import SamplingParams
    engine = chat_engine(serve_model, serve_tokenizer, {"tool_use": False}, max_batch=8)
    try:
        prompt = [serve_tokenizer.bos_id] + serve_tokenizer.encode("Hello!")
        plain = [SamplingParams(temperature=1.0, max_tokens=20, seed=s) for s in range(4)]
        alone = [engine.generate(prompt, p)[0] for p in plain]
        from model.chat_engine import run_all
        mixed = run_all(engine, [(prompt, p) for p in plain] + [
            (prompt, SamplingParams(temperature=1.0, max_tokens=100, seed=9, grammar=json_grammar(NESTED)))])
        assert [[t.id for t in toks] for toks, _ in mixed[:4]] == alone
        assert json.loads(serve_tokenizer.decode([t.id for t in mixed[4][0]])) is not None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "nope"},
                                             "strict": True}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "xml"}, "response_format"),
])
def test_bad_schemas_are_400s_naming_the_field(serve_openai_client, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        serve_openai_client.chat.completions.create(model="sparkchat", messages=ask(0), response_format=fmt)
    err = e.value.body if isinstance(e.value.body, dict) and "param" in e.value.body else e.value.body["error"]
    assert err["param"] == param and err["message"]


def test_schema_size_and_depth_are_bounded(serve_openai_client):
    from model.grammar import MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_CHARS // 10)}}
    for schema, words in ((deep, "deeper"), (wide, "characters")):
        with pytest.raises(openai.BadRequestError) as e:
            serve_openai_client.chat.completions.create(model="sparkchat", messages=ask(0), response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert words in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        serve_openai_client.responses.create(model="sparkchat", input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": deep}})
    assert "text.format" in e.value.message
