"""OpenAI's Responses API on the live server, driven by the openai package's own `client.responses.create`,
streamed and not: the same model, renderer and engine as chat completions, OpenAI's shapes and events."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import broken_app

from model.chat import render
from serve.api import Settings, create_app

pytestmark = pytest.mark.timeout(120)

EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(serve_start, serve_model_dir):
    server = serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False)))
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tool_client(serve_start, conv_tool_model_dir):
    """A model that ends its replies: a response that completes."""
    server = serve_start(create_app(Settings(model_dir=conv_tool_model_dir, ui=False)))
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy_chat(client, messages, max_tokens):
    return client.chat.completions.create(model="sparkchat", messages=messages, max_tokens=max_tokens,
                                          temperature=0).choices[0].message.content


def test_a_response_is_the_chat_reply(client, serve_tokenizer):
    r = client.responses.create(model="sparkchat", input="Hello! How are you today?", instructions="Be brief.",
                                max_output_tokens=6, temperature=0, metadata={"run": "7"})
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you today?"}]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "sparkchat"
    assert r.output_text == greedy_chat(client, conversation, 6) and r.output_text
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [p.type for p in message.content] == ["output_text"]
    # the fixture model never ends by itself: the budget ended it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    prompt = len(render(serve_tokenizer, conversation, for_completion=True)[0])
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (prompt, 6, prompt + 6)
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata) == ("Be brief.", 6, 0.0, {"run": "7"})


def test_a_streamed_response_is_openais_event_sequence(client):
    kw = dict(model="sparkchat", input=[{"role": "user", "content": "Hello! How are you today?"}],
              max_output_tokens=8, temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == EVENTS[:4] + ["response.output_text.delta"] * len(deltas) + EVENTS[4:] + ["response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = client.responses.create(**kw)
    assert "".join(deltas) == events[-4].text == whole.output_text  # greedy: the same reply, in pieces
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.usage.output_tokens == 8 and final.usage.input_tokens == whole.usage.input_tokens
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id")) and final.output[0].id == item_id


def test_a_reply_that_ends_completes(tool_client, conv_tool_chats):
    question, reply = conv_tool_chats[2]  # "Hello!" -> "Hello! How can I help you?", learned by heart
    r = tool_client.responses.create(model="sparkchat", input=question["content"])
    assert r.status == "completed" and r.incomplete_details is None and r.output_text == reply["content"]
    events = list(tool_client.responses.create(model="sparkchat", input=question["content"], stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == reply["content"]
    assert events[-2].item.status == "completed"


def test_the_conversation_goes_on_with_the_output_sent_back(client, serve_tokenizer):
    first = client.responses.create(model="sparkchat", input="Hello!", max_output_tokens=4, temperature=0)
    then = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello!"}, *first.output,
            {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "you?"}]}]
    r = client.responses.create(model="sparkchat", input=then, max_output_tokens=8, temperature=0)
    as_chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And you?"}]
    assert r.usage.input_tokens == len(render(serve_tokenizer, as_chat, for_completion=True)[0])
    assert r.output_text == greedy_chat(client, as_chat, 8)
    # the developer message is the system prompt, not one more user turn: the reply above is the system
    # prompt's, and the two prompts differ (their first token's logprobs; a peaked random model may write
    # the same greedy words after both)
    def first_logprob(messages):
        return client.chat.completions.create(model="sparkchat", messages=messages, max_tokens=1, temperature=0,
                                              logprobs=True).choices[0].logprobs.content[0].logprob
    assert first_logprob(as_chat) != first_logprob([{**as_chat[0], "role": "user"}, *as_chat[1:]])


def test_the_sse_frames_name_their_event(client):
    body = {"model": "sparkchat", "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", str(client.base_url).rstrip("/") + "/responses", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f]
    for frame in frames:  # OpenAI's framing: the event's name, then its JSON, which names it again
        event, data = frame.split("\n")
        assert event.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == event[7:]


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}] * 2}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format"),
    ({"extra_body": {"foo": 1}}, "foo"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "[1]"}]}, "input[1].arguments"),
    ({"input": [{"role": "user", "content": "Hi"}, {"role": "developer", "content": "Be brief."}]}, "input[1].role"),
    ({"instructions": "Be brief.", "input": [{"role": "system", "content": "Be long."}]}, "input[0].role"),
    ({"input": "The quick brown fox jumps over the lazy dog. " * 40}, "input"),
])
def test_400_names_the_field(client, kw, param):
    kw = {"model": "sparkchat", "input": "Hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw)
    err = e.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err


def test_an_engine_failure_is_a_failed_response(serve_start, serve_model_dir):
    server = serve_start(broken_app(serve_model_dir))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.responses.create(model="sparkchat", input="Hi", max_output_tokens=4)
    assert r.status == "failed" and r.error.code == "server_error" and r.incomplete_details is None
    events = list(client.responses.create(model="sparkchat", input="Hi", max_output_tokens=4, stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"


def test_404_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5", input="Hi")
    assert e.value.response.json()["error"]["code"] == "model_not_found"


# ---- function calling: tools, tool_choice, function_call items out and function_call_output items back ----

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
         {"type": "function", "name": "add", "description": "Add", "parameters": ADD}]


def test_a_forced_call_is_a_function_call_item(client):
    """tool_choice required or named: the grammar makes even the random model's reply one valid call."""
    import jsonschema
    for i, choice in enumerate(["required", {"type": "function", "name": "get_weather"}]):
        r = client.responses.create(model="sparkchat", input=f"Help me {i}", tools=TOOLS, tool_choice=choice,
                                    parallel_tool_calls=False, max_output_tokens=100, temperature=0)
        assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]  # no empty message
        call = r.output[0]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), {"get_weather": WEATHER, "add": ADD}[call.name])
        assert (r.tool_choice if isinstance(choice, str) else r.tool_choice.model_dump()) == choice
        assert [t.name for t in r.tools] == ["get_weather", "add"]
    assert call.name == "get_weather"


def test_a_streamed_call_is_openais_event_sequence(client):
    kw = dict(model="sparkchat", input="Help me", tools=TOOLS, tool_choice={"type": "function", "name": "add"},
              max_output_tokens=100, temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, delta, done, item_done, final = events[2:]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
    whole = client.responses.create(**kw).output[0]  # greedy: the same call
    assert delta.delta == done.arguments == item_done.item.arguments == whole.arguments
    assert delta.item_id == done.item_id == added.item.id == item_done.item.id == final.response.output[0].id
    assert final.response.output[0].call_id == added.item.call_id and item_done.item.name == "add"


def test_auto_call_and_its_output_fed_back(serve_start, conv_call_model_dir):
    """The model that learned to call get_weather chooses to (tool_choice auto), and answers with the
    function_call_output sent back after its call item."""
    from conftest import CONV_FUNCTIONS
    server = serve_start(create_app(Settings(model_dir=conv_call_model_dir, ui=False)))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    tools = [{"type": "function", **f} for f in CONV_FUNCTIONS]
    r = client.responses.create(model="sparkchat", input="Weather in Paris?", tools=tools, temperature=0)
    call, = r.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert r.tool_choice == "auto"
    back = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "21"}]
    r = client.responses.create(model="sparkchat", input=back, tools=tools, temperature=0)
    assert r.output_text == "It is 21 in Paris." and [o.type for o in r.output] == ["message"]
    streamed = list(client.responses.create(model="sparkchat", input=back, tools=tools, temperature=0, stream=True))
    assert streamed[-1].response.output_text == "It is 21 in Paris."
