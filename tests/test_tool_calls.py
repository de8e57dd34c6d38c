"""Function calling through the real server: tool_choice required and named give valid calls (the
grammar makes even the session's random model write one), tool_calls in replies and in streamed deltas,
tool messages fed back, the 400s naming the field, and LangChain's bind_tools loop."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest


ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
         {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SCHEMAS = {"add": ADD, "get_weather": WEATHER}


def ask(serve_openai_client, i=0, **kw):
    return serve_openai_client.chat.completions.create(model="sparkchat", messages=[{"role": "user", "content": f"Help me {i}"}],
                                          tools=TOOLS, max_tokens=100, seed=i, **kw)


def valid(call, names=SCHEMAS) -> bool:
    jsonschema.validate(json.loads(call.function.arguments), names[call.function.name])
    return call.type == "function" and call.id.startswith("call_")


def test_required_20_of_20_valid_calls(serve_openai_client):
    for i in range(20):
        r = ask(serve_openai_client, i, tool_choice="required", parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and valid(c.message.tool_calls[0])


def test_named_function_20_of_20(serve_openai_client):
    for i in range(20):
        r = ask(serve_openai_client, i, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather" and valid(calls[0])


def test_streamed_tool_call_deltas(serve_openai_client):
    chunks = list(ask(serve_openai_client, 3, tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and valid(deltas[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_none_makes_no_call_and_results_feed_back(serve_openai_client):
    r = ask(serve_openai_client, 1, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    first = ask(serve_openai_client, 2, tool_choice={"type": "function", "function": {"name": "add"}})
    msg = first.choices[0].message
    back = [{"role": "user", "content": "Help me 2"}, msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"}]
    r = serve_openai_client.chat.completions.create(model="sparkchat", messages=back, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content


@pytest.mark.parametrize("kw, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, "messages[1].tool_calls[0].function.arguments"),
])
def test_400s_name_the_field(serve_openai_client, kw, param):
    body = {"model": "sparkchat", "messages": [{"role": "user", "content": "hi"}], **kw}
    with pytest.raises(openai.BadRequestError) as e:
        serve_openai_client.chat.completions.create(**body)
    err = e.value.body if isinstance(e.value.body, dict) and "param" in e.value.body else e.value.body["error"]
    assert err["param"] == param and err["message"]


def test_langchain_bind_tools_two_step_loop(serve_openai_client):
    """A call, its result, a final answer: LangChain's agent loop against the server."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    from pydantic import BaseModel, Field

    class add(BaseModel):  # a tool as LangChain takes it: bounded, so the random model's numbers end
        """Add two numbers."""
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    llm = ChatOpenAI(base_url=str(serve_openai_client.base_url), api_key="unused", model="sparkchat", max_tokens=90,
                     max_retries=0)
    messages = [HumanMessage("What is 2 + 3?")]
    ai = llm.bind_tools([add], tool_choice="add").invoke(messages)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "add"
    args = add(**ai.tool_calls[0]["args"])  # valid arguments
    messages += [ai, ToolMessage(str(args.a + args.b), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([add], tool_choice="none").invoke(messages)
    assert not final.tool_calls and isinstance(final.content, str) and final.content


# ---- the synthetic tool-use task and its score ----

def test_the_tool_task_is_seeded_and_its_conversations_render(serve_tokenizer):
    from model.chat import render
    from pipeline import tool_tasks
    items = tool_tasks.generate(200, 7)
    assert items == tool_tasks.generate(200, 7)
    calls = [it for it in items if it["call"]]
    assert 0.4 < len(calls) / len(items) < 0.8 and all(it["call"]["name"] in {t["name"] for t in it["tools"]}
                                                       for it in calls)
    s = serve_tokenizer.special
    conv = tool_tasks.conversation(calls[0])
    ids, mask = render(serve_tokenizer, conv["messages"], tools=conv["tools"])
    learned = [i for i, m in zip(ids, mask) if m]
    assert s["<|call_start|>"] in learned and s["<|result_start|>"] not in learned  # the call is learned, its result given
    assert s["<|tools_start|>"] in ids


def test_the_tool_score_counts_right_calls_and_calls_where_none_fits():
    from model.tools import call_text
    from pipeline import tool_tasks
    items = tool_tasks.generate_eval(40, 3)
    assert len({tool_tasks.key(it) for it in items}) == 40
    gold = [[call_text(it["call"]["name"], it["call"]["arguments"])] if it["call"] else [] for it in items]
    assert tool_tasks.score(items, gold) == {"tool_call": 1.0, "tool_none": 1.0}
    wrong_args = [[call_text(it["call"]["name"], {})] if it["call"] else [] for it in items]
    always = [[call_text(it["tools"][0]["name"], {})] for it in items]
    assert tool_tasks.score(items, wrong_args)["tool_call"] == 0.0
    assert tool_tasks.score(items, always)["tool_none"] == 0.0


def test_the_tool_failures_say_how_each_reply_failed():
    from model.tools import call_text
    from pipeline import tool_tasks
    items = tool_tasks.generate_eval(40, 3)
    calls = [it for it in items if it["call"]]
    nones = [it for it in items if not it["call"]]
    gold = [[call_text(it["call"]["name"], it["call"]["arguments"])] if it["call"] else [] for it in items]
    assert tool_tasks.failures(items, gold) == {}
    other = {it["call"]["name"]: next(t["name"] for t in it["tools"] if t["name"] != it["call"]["name"]) for it in calls}
    replies = {"no_call": [], "many_calls": gold[0] * 2 if items[0]["call"] else ["x", "y"], "not_a_call": ["{nope"]}
    for kind, reply in replies.items():
        assert tool_tasks.outcome(calls[0], reply) == kind
    assert tool_tasks.outcome(calls[0], [call_text(other[calls[0]["call"]["name"]], {})]) == "wrong_function"
    assert tool_tasks.outcome(calls[0], [call_text(calls[0]["call"]["name"], {"bogus": 1})]) == "invalid_arguments"
    price = next(it for it in calls if it["call"]["name"] == "get_price")
    assert tool_tasks.outcome(price, [call_text("get_price", {"item": "nothing"})]) == "wrong_arguments"
    assert tool_tasks.outcome(nones[0], gold[items.index(calls[0])]) == "called_when_none_fits"
    counted = tool_tasks.failures(items, [[] for _ in items])  # no call anywhere: every call item failed so
    assert sum(n for per in counted.values() for n in per.values()) == len(calls) and "none" not in counted
    assert all(set(per) == {"no_call"} for per in counted.values())
