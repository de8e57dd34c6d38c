"""The Gradio chat page, mounted at / on the API's own app and port.

It drives the same `Runtime` (and so the same engine batch) in-process: no HTTP call to itself. The
reply streams as it is generated; Gradio's stop button cancels the generator, which frees the engine
row at once (TextStream cancels on close).
"""
from __future__ import annotations

import hmac

import gradio as gr
from fastapi import FastAPI

from model.chat import ChatFormatError
from model.engine import EngineStopped, QueueFull


def _text(content) -> str:
    """Gradio history content (a string, a list of parts, or a component dict) -> plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text", "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "".join(_text(c) for c in content)
    return ""


def to_messages(message, history, system_prompt: str) -> list[dict]:
    msgs = [{"role": "system", "content": system_prompt.strip()}] if system_prompt and system_prompt.strip() else []
    for turn in history or []:
        role = turn.get("role") if isinstance(turn, dict) else None
        if role in ("user", "assistant"):
            text = _text(turn.get("content"))
            if msgs and msgs[-1]["role"] == role:  # gradio may split one turn into several messages
                msgs[-1]["content"] += text
            else:
                msgs.append({"role": role, "content": text})
    msgs.append({"role": "user", "content": _text(message)})
    return msgs


def build_ui(app: FastAPI) -> gr.ChatInterface:
    async def respond(message, history, system_prompt, temperature, top_k, max_tokens):
        runtime = app.state.runtime
        if runtime is None:
            raise gr.Error("The model is still loading; try again in a moment.")
        try:
            prompt = runtime.render(to_messages(message, history, system_prompt))
        except ChatFormatError as e:
            raise gr.Error(str(e))
        if len(prompt) >= runtime.context_len:
            raise gr.Error(f"The conversation is {len(prompt)} tokens, over the model's context of "
                           f"{runtime.context_len}. Clear the chat to start again.")
        params = runtime.sampling(temperature=temperature, top_k=int(top_k), max_tokens=int(max_tokens))
        try:
            stream = runtime.open_stream(prompt, params)
        except (QueueFull, EngineStopped) as e:
            raise gr.Error(f"The server is busy ({e}); try again shortly.")
        reply = ""
        async for piece in stream:  # closing this generator (stop button) cancels the stream
            reply += piece
            yield reply
        if not reply:
            yield "(empty reply)"

    return gr.ChatInterface(
        respond,
        title="sparkchat",
        description="A small ChatGPT-style model, trained from scratch.",
        textbox=gr.Textbox(placeholder="Message sparkchat", show_label=False, scale=7, autofocus=True,
                           submit_btn=True, stop_btn=True),
        additional_inputs=[
            gr.Textbox(label="System prompt", value="", lines=2, render=False),
            gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature", render=False),
            gr.Slider(0, 200, value=50, step=1, label="Top-k (0: off)", render=False),
            gr.Slider(1, 1024, value=256, step=1, label="Max tokens", render=False),
        ],
        additional_inputs_accordion=gr.Accordion("Settings: system prompt, sampling", open=False, render=False),
        stop_btn=True,
        fill_height=True,
    )


def mount_ui(app: FastAPI, settings) -> None:
    auth = None
    if settings.api_key:
        key = settings.api_key
        auth = lambda _user, password: hmac.compare_digest(str(password), key)  # noqa: E731
    gr.mount_gradio_app(app, build_ui(app), path="/", auth=auth,
                        auth_message="Log in with any user name and the server's API key as the password.",
                        footer_links=[], ssr_mode=False)
