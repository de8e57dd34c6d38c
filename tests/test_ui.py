"""The Gradio page's pieces without a browser: a reply as chat messages, the history rebuilt as trained,
the model line read from files, the examples and the max-tokens bound."""
from __future__ import annotations

import json
import shutil
import time

import gradio as gr
import pytest
from fastapi import FastAPI

from model.chat import FunctionCall, ToolUse
from serve.api import Settings
from serve.ui import (CALL_TITLE, EMPTY, EXAMPLES, RESULT_TITLE, TOOL_TITLE, build_ui, fit_prompt, model_line,
                      reply_messages, respond, to_messages, turn_key)
from sparkchat import paths

pytestmark = pytest.mark.timeout(60)


def test_a_reply_is_its_tool_messages_then_its_words():
    msgs = reply_messages("We need 12 + 30 = 42.", [ToolUse("12 + 30", "42")], done=True)
    tool, words = msgs
    assert tool.metadata == {"title": TOOL_TITLE, "log": "12 + 30 → 42", "status": "done"}  # collapsed
    assert "12 + 30" in tool.content and "42" in tool.content
    assert words.content == "We need 12 + 30 = 42." and not words.metadata
    assert [m.content for m in reply_messages("", [], done=True)] == [EMPTY]
    assert reply_messages("", [], done=False) == []  # nothing yet while it streams


def test_history_rebuilds_the_reply_parts(conv_tool_chats):
    question, trained = conv_tool_chats[1]
    words = "We need 12 + 30 = 42."
    # what Gradio hands back: the tool message and the words as separate assistant messages
    history = [{"role": "user", "content": [{"type": "text", "text": question["content"]}], "metadata": None},
               {"role": "assistant", "content": [{"type": "text", "text": "```\n12 + 30\n```\nresult: `42`"}],
                "metadata": {"title": TOOL_TITLE, "log": "12 + 30 → 42", "status": "done"}},
               {"role": "assistant", "content": [{"type": "text", "text": words}], "metadata": None}]
    key = turn_key(["```\n12 + 30\n```\nresult: `42`", words])  # the reply's messages, as it showed them
    msgs = to_messages("Hello!", history, " Be brief. ", {key: trained["content"]})
    assert msgs == [{"role": "system", "content": "Be brief."}, question, trained,
                    {"role": "user", "content": "Hello!"}]
    # a reply the page did not produce (no parts kept for it) is its words
    assert to_messages("Hello!", history, "", {})[1] == {"role": "assistant", "content": words}


CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'


def test_a_function_call_shows_its_name_and_arguments_and_its_result_once_fed_back():
    msgs = reply_messages("", [], done=True, calls=[FunctionCall(CALL)])
    assert len(msgs) == 1 and msgs[0].metadata["title"] == f"{CALL_TITLE}: get_weather"  # no "(empty reply)"
    assert 'get_weather {"city": "Paris"}' in msgs[0].content
    fed = reply_messages("It is 21.", [], done=True, answered=[FunctionCall(CALL, "21")])
    assert fed[0].metadata["title"] == RESULT_TITLE and 'get_weather {"city": "Paris"} → 21' in fed[0].content
    assert fed[1].content == "It is 21." and not fed[1].metadata
    # the history: the message after a reply that called is the call's result, a tool message
    shown = [m.content for m in msgs]
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": shown[0], "metadata": msgs[0].metadata}]
    parts = [{"type": "call", "text": CALL}]
    assert to_messages("21", history, "", {turn_key(shown): parts}) == [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": parts}, {"role": "tool", "content": "21"}]
    assert to_messages("21", history, "", {})[-1]["role"] == "user"  # a reply the page did not make: its words


def page_turn(server, *args) -> tuple[list, dict]:
    """respond's last (messages, replies), run on the server's loop (where its runtime's streams live)."""
    import asyncio

    async def turn():
        last = None
        async for last in respond(server.app, *args):
            pass
        return last
    return asyncio.run_coroutine_threadsafe(turn(), server.app.state.runtime.link.loop).result(60)


@pytest.mark.timeout(300)  # a model trained and a server started first
def test_the_page_offers_tools_shows_the_call_and_feeds_the_result_back(serve_start, conv_call_model_dir):
    """The real model that learned to call get_weather: the page's Tools box offers it, the reply is the call,
    and the user's next message goes back as its result, which the answer uses."""
    from conftest import CONV_FUNCTIONS

    from serve.api import create_app
    server = serve_start(create_app(Settings(model_dir=conv_call_model_dir, ui=False, device="cpu")))
    tools = json.dumps([{"type": "function", "function": f} for f in CONV_FUNCTIONS])
    shown, replies = page_turn(server, "Weather in Paris?", [], "", tools, 0.0, 0, 0, {})
    assert [m.metadata["title"] for m in shown] == [f"{CALL_TITLE}: get_weather"]
    assert 'get_weather {"city": "Paris"}' in shown[0].content
    history = [{"role": "user", "content": "Weather in Paris?"}] + [
        {"role": "assistant", "content": m.content, "metadata": m.metadata} for m in shown]
    shown, _ = page_turn(server, "21", history, "", tools, 0.0, 0, 0, replies)
    assert shown[0].metadata["title"] == RESULT_TITLE and "→ 21" in shown[0].content
    assert [m.content for m in shown[1:]] == ["It is 21 in Paris."]
    with pytest.raises(gr.Error, match=r"Tools\[0\]\.function\.name"):
        page_turn(server, "Hi", [], "", json.dumps([{"type": "function", "function": {"name": "a b"}}]), 0.0, 0, 0, {})


def test_model_line_reads_the_model_dir_and_the_pipeline_reports(tmp_path, serve_model_dir):
    model_dir = tmp_path / paths.CHAT_MODEL
    shutil.copytree(serve_model_dir, model_dir)
    (model_dir / "meta.json").write_text(json.dumps({"stage": "sft", "steps": 7, "params": 2_500_000,
                                                     "tokens": 3_100_000, "backend_label": "bf16"}))
    assert model_line(model_dir, tmp_path) == (f"Serving `{model_dir}`: 2.5M parameters, 2 layers, context 128 "
                                               "tokens; sft: 7 steps, 3.1M tokens, bf16.")
    served = next(n for n, d in paths.EVAL_MODELS.items() if d == paths.CHAT_MODEL)  # the final chat model's name
    for model, scores in {served: {"arithmetic": 0.37, "largest": 0.5, "val_bpb_text": 1.2, "chatcore": 0.1},
                          "base": {"arithmetic": 0.01}}.items():
        metrics = tmp_path / paths.metrics_file(paths.eval_reports(model))
        metrics.parent.mkdir(parents=True)
        metrics.write_text(json.dumps(scores))
        (tmp_path / paths.details_file(paths.eval_reports(model))).write_text(
            json.dumps({"chance": {"arithmetic": 0.0, "largest": 0.25}}))
    prepare = tmp_path / paths.stage_params("prepare")
    prepare.parent.mkdir(parents=True)
    prepare.write_text(json.dumps({"data": {"pretrain_sources": ["a.txt"], "chat_sources": ["builtin:synthetic"]}}))
    line = model_line(model_dir, tmp_path)
    assert line.endswith("; trained on a.txt, builtin:synthetic. Held-out scores: arithmetic 37%, "
                         "largest 50% (chance 25%).")
    # another directory: the pipeline's scores are not about it
    assert "Held-out" not in model_line(serve_model_dir, tmp_path)
    assert model_line(tmp_path / "missing", tmp_path) == f"Serving `{tmp_path / 'missing'}`."


def test_examples_and_max_tokens_bounded_by_the_context(serve_model_dir):
    app = FastAPI()
    app.state.settings, app.state.runtime = Settings(model_dir=serve_model_dir), None
    page = build_ui(app)
    sliders = [b for b in page.blocks.values() if isinstance(b, gr.Slider) and b.label.startswith("Max tokens")]
    assert len(sliders) == 1 and sliders[0].maximum == 128 and sliders[0].value == 0  # what the context leaves
    assert "up to 16" in sliders[0].label  # generation.json's
    chatbot = next(b for b in page.blocks.values() if isinstance(b, gr.Chatbot))
    assert [e["text"] for e in chatbot.examples] == EXAMPLES


def exchanges(n: int) -> list[dict]:
    msgs = []
    for i in range(n):
        msgs += [{"role": "user", "content": f"Sea {i}?"},
                 {"role": "assistant", "content": f"Water {i}."}]
    return msgs + [{"role": "user", "content": "Sky?"}]


def test_the_reply_budget_is_what_the_context_leaves_and_the_history_stays(serve_tokenizer):
    """The page's default (max tokens 0): a conversation keeps all its turns while the reply still has
    a quarter of the 128-token context, and the reply may use all the rest (up to generation.json's)."""
    from model.chat import render
    tok = serve_tokenizer
    n = max(k for k in range(1, 20) if len(render(tok, exchanges(k), for_completion=True)[0]) <= 96)
    full = render(tok, exchanges(n), for_completion=True)[0]
    assert len(full) > 64  # over the half the page kept before: its second or third turn dropped the first
    ids, budget, dropped = fit_prompt(tok, 128, exchanges(n), 0, 256)
    assert (ids, budget, dropped) == (full, 128 - len(full), 0)
    assert fit_prompt(tok, 128, exchanges(n), 0, 10)[1] == 10  # the model's own default caps it
    # one exchange more: the oldest leave, and only as many as the reply's quarter needs
    ids, budget, dropped = fit_prompt(tok, 128, exchanges(n + 1), 0, 256)
    assert dropped >= 2 and len(ids) <= 96 and budget == 128 - len(ids)
    kept_one_more = render(tok, exchanges(n + 1)[dropped - 2:], for_completion=True)[0]
    assert len(kept_one_more) > 96
    # a budget the user sets keeps its own room, as the terminal's
    ids, budget, dropped = fit_prompt(tok, 128, exchanges(n), 50, 256)
    assert budget == min(50, 128 - len(ids)) and len(ids) <= 128 - 50 and dropped > 0


def test_an_idle_chat_page_does_not_poll_its_queue_every_millisecond(serve_model_dir, monkeypatch):
    """Gradio's queue sleeps between looks for a job (1 ms by default on Linux) and for progress to send
    (10 ms): wake-ups of the front end's loop, which every API stream shares, while the page is idle.
    Only this page's queue's sleeps count (other tests' servers may still run theirs)."""
    import asyncio

    import gradio.queueing
    from starlette.testclient import TestClient

    from serve.ui import QUEUE_POLL_S, mount_ui
    app = FastAPI()
    app.state.settings, app.state.runtime = Settings(model_dir=serve_model_dir), None
    queue = mount_ui(app, app.state.settings)._queue
    sleeps: list[float] = []  # when each of its idle sleeps began
    real_sleep = asyncio.sleep

    async def counted(delay, *args, **kwargs):
        frame = asyncio.current_task().get_coro().cr_frame
        if frame is not None and frame.f_locals.get("self") is queue:
            sleeps.append(time.monotonic())
        return await real_sleep(delay, *args, **kwargs)

    monkeypatch.setattr(gradio.queueing.asyncio, "sleep", counted)
    with TestClient(app):  # its lifespan starts the page's queue
        time.sleep(0.5)
    assert len(sleeps) > 2
    rate = (len(sleeps) - 1) / (sleeps[-1] - sleeps[0])
    assert rate <= 2 / QUEUE_POLL_S * 1.5, f"{rate:.0f} idle sleeps a second"  # two loops: jobs, progress
