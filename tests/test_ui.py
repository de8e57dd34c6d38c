"""The Gradio page's pieces without a browser: a reply as chat messages, the history rebuilt as trained,
the model line read from files, the examples and the max-tokens bound."""
from __future__ import annotations

import json
import shutil

import gradio as gr
import pytest
from fastapi import FastAPI

from model.chat import ToolUse
from serve.api import Settings
from serve.ui import EMPTY, EXAMPLES, TOOL_TITLE, build_ui, model_line, reply_messages, to_messages
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
    msgs = to_messages("Hello!", history, " Be brief. ", {words: trained["content"]})
    assert msgs == [{"role": "system", "content": "Be brief."}, question, trained,
                    {"role": "user", "content": "Hello!"}]
    # a reply the page did not produce (no parts kept for it) is its words
    assert to_messages("Hello!", history, "", {})[1] == {"role": "assistant", "content": words}


def test_model_line_reads_the_model_dir_and_the_pipeline_reports(tmp_path, serve_model_dir):
    model_dir = tmp_path / paths.CHAT_MODEL
    shutil.copytree(serve_model_dir, model_dir)
    (model_dir / "meta.json").write_text(json.dumps({"stage": "sft", "steps": 7, "params": 2_500_000,
                                                     "tokens": 3_100_000, "backend_label": "bf16"}))
    assert model_line(model_dir, tmp_path) == (f"Serving `{model_dir}`: 2.5M parameters, 2 layers, context 128 "
                                               "tokens; sft: 7 steps, 3.1M tokens, bf16.")
    metrics = tmp_path / paths.metrics_file("evaluate")
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"sft": {"arithmetic": 0.37, "largest": 0.5, "val_bpb": 1.2},
                                   "base": {"arithmetic": 0.01}, "chance": {"arithmetic": 0.0, "largest": 0.25}}))
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
    assert len(sliders) == 1 and sliders[0].maximum == 128 and sliders[0].value == 16  # generation.json's
    chatbot = next(b for b in page.blocks.values() if isinstance(b, gr.Chatbot))
    assert [e["text"] for e in chatbot.examples] == EXAMPLES
