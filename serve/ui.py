"""The Gradio chat page, mounted at / on the API's own app and port.

It drives the front end's own `Runtime` (and so the same engine batch): no HTTP call to itself. The
reply streams as it is generated; Gradio's stop button cancels the generator, which frees the engine
row at once (TextStream cancels on close).

A reply shows as the API and the terminal show it (model.chat.ReplyReader): each calculator use as a
collapsed tool message, then the assistant's words, then each call of a function as a collapsed message
(its name and arguments). Functions are offered through the settings' Tools box (OpenAI `tools` entries,
checked as the API checks them); a reply that calls one takes the user's next message as the result (a
`tool` message, as the API's client would send it), shown at the start of the reply it brings. Gradio
gives back each message's text, so the page keeps each reply's parts (calculator calls, results, function
calls and answer line, as the model wrote them) in a per-session State keyed by the text of the turn's
messages (`turn_key`), and the next turn's prompt renders the history as trained.
A conversation that outgrows the context loses its oldest exchanges, as in the terminal, with a note; by
default the reply may take what the context leaves, so the history leaves only when it must (fit_prompt).

Above the chat, a line says which model is served: its size and training from the model directory, and
its held-out scores from the evaluate stage's metrics when the served directory is one it scored.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
from pathlib import Path
from urllib.parse import parse_qs

import gradio as gr
from fastapi import FastAPI
from gradio.route_utils import API_PREFIX, FnIndexInferError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Mount

from .bodies import replayed
from .errors import error_response
from .tool_calls import parse_definitions

from model.chat import ChatFormatError, FunctionCall, ToolUse, fit_history, history_budget
from model.requests import EngineStopped, QueueFull
from model.model_info import describe_model_dir
from sparkchat import paths

# What the default model does reliably (pipeline/synthetic.py's tasks; scores on the model line above the
# chat): arithmetic and word problems with the calculator, letter counting, capitals, who it is.
# Spelling and the largest of four are left out: it scores 0 and about twice chance on them.
EXAMPLES = [
    "What is 37 + 58?",
    "Maya has 12 apples and gets 30 more. How many apples does Maya have now?",
    "How many times does the letter 'e' appear in 'cheese'?",
    "What is the capital of France?",
    "Who are you?",
]
TOOL_TITLE = "Calculator"
CALL_TITLE = "Function call"  # + ": name"
RESULT_TITLE = "Function result"
TOOLS_LABEL = "Tools (OpenAI `tools` JSON; a call's result is your next message)"
EMPTY = "(empty reply)"
log = logging.getLogger("sparkchat.serve")
QUEUE_POLL_S = 0.05  # how often the chat page's queue looks for a new job while it has none (mount_ui)


def _text(content) -> str:
    """Gradio history content (a string, a list of parts, or a component dict) -> plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text", "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "".join(_text(c) for c in content)
    return ""


def _is_tool(turn: dict) -> bool:
    return bool((turn.get("metadata") or {}).get("title"))


def turn_key(texts: list[str]) -> str:
    """What a reply's parts are kept under: the text of every message the reply showed (tool messages too),
    in order, so a reply with no words (a function call) is found too."""
    return "\n".join(texts)


def to_messages(message, history, system_prompt: str, replies: dict | None = None) -> list[dict]:
    """Gradio's history + the new message -> chat messages. Gradio may split a turn into several messages
    (a reply is its tool messages and its words); an assistant turn whose `turn_key` is in `replies` (->
    parts, kept by respond) becomes those parts, any other its words as plain text. A user message after a
    reply that called a function is that call's result: a `tool` message."""
    msgs = [{"role": "system", "content": system_prompt.strip()}] if system_prompt and system_prompt.strip() else []
    for turn in history or []:
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ("user", "assistant"):
            continue
        text = _text(turn.get("content"))
        words = "" if _is_tool(turn) else text
        if msgs and msgs[-1]["role"] == role and "texts" in msgs[-1]:
            msgs[-1]["words"] += words
            msgs[-1]["texts"].append(text)
        else:
            msgs.append({"role": role, "words": words, "texts": [text]})
    for m in msgs:
        if "words" in m:
            words, key = m.pop("words"), turn_key(m.pop("texts"))
            m["content"] = (replies or {}).get(key, words) if m["role"] == "assistant" else words
    msgs.append({"role": "user", "content": _text(message)})
    for prev, m in zip(msgs, msgs[1:]):
        if m["role"] == "user" and called(prev):
            m["role"] = "tool"
    return msgs


def called(message: dict) -> list[FunctionCall]:
    """The function calls of an assistant message whose content is parts (none for any other)."""
    if message["role"] != "assistant" or isinstance(message["content"], str):
        return []
    return [FunctionCall(p["text"]) for p in message["content"] if p["type"] == "call"]


def reply_messages(words: str, tool_uses: list[ToolUse], done: bool = False, calls: list[FunctionCall] = (),
                   answered: list[FunctionCall] = ()) -> list[gr.ChatMessage]:
    """A reply as chat messages: the calls whose result the user's message brought (`answered`, with their
    results), a collapsed tool message per calculator use, the words, then a collapsed message per call."""
    out = [gr.ChatMessage(role="assistant", metadata={"title": RESULT_TITLE, "log": str(c), "status": "done"},
                          content=f"```\n{c}\n```") for c in answered]
    out += [gr.ChatMessage(role="assistant", metadata={"title": TOOL_TITLE, "log": str(u), "status": "done"},
                           content=f"```\n{u.call}\n```\n" + ("no result" if u.output is None else f"result: `{u.output}`"))
            for u in tool_uses]
    if words or (done and not out and not calls):
        out.append(gr.ChatMessage(role="assistant", content=words or EMPTY))
    out += [gr.ChatMessage(role="assistant", metadata={"title": f"{CALL_TITLE}: {_call_name(c)}", "log": str(c),
                                                       "status": "done"},
                           content=f"```\n{c}\n```\nYour next message is its result.") for c in calls]
    return out


def _call_name(call: FunctionCall) -> str:
    return str(call).split(" ", 1)[0]


def _shown_texts(messages: list[gr.ChatMessage]) -> list[str]:
    return [_text(m.content) for m in messages]


def model_line(model_dir: Path, root: Path = Path(".")) -> str:
    """Which model is served, in one line of markdown: from the model directory's files, and the
    evaluate stage's held-out scores (`root` / paths.eval_reports) when it scored this directory."""
    d = describe_model_dir(model_dir)
    cfg, meta = d["config"], d["meta"]
    if not cfg:
        return f"Serving `{model_dir}`."
    size = f"{meta['params'] / 1e6:.1f}M parameters, " if "params" in meta else ""
    out = [f"Serving `{model_dir}`: {size}{cfg.get('n_layer', '?')} layers, context {cfg.get('seq_len', '?')} tokens"]
    if "stage" in meta:
        tokens = f", {meta['tokens'] / 1e6:.1f}M tokens" if "tokens" in meta else ""
        out.append(f"; {meta['stage']}: {meta.get('steps', '?')} steps{tokens}, {meta.get('backend_label', '?')}")
    try:
        data = json.loads((root / paths.stage_params("prepare")).read_text())["data"]
        out.append(f"; trained on {', '.join(data['pretrain_sources'] + data['chat_sources'])}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    out.append(".")
    name = next((n for n, p in paths.EVAL_MODELS.items() if (root / p).resolve() == Path(model_dir).resolve()), None)
    try:
        reports = paths.eval_reports(name)
        scores = json.loads((root / paths.metrics_file(reports)).read_text())
        chance = json.loads((root / paths.details_file(reports)).read_text()).get("chance", {})
        out.append(" Held-out scores: " + ", ".join(
            f"{task.replace('_', ' ')} {v:.0%}" + (f" (chance {chance[task]:.0%})" if chance.get(task) else "")
            for task, v in scores.items() if task in chance) + ".")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return "".join(out)


def read_tools(text: str) -> list[dict] | None:
    """The Tools box: empty, or a JSON list of OpenAI `tools` entries (a gr.Error says what is wrong)."""
    if not text or not text.strip():
        return None
    try:
        return parse_definitions(json.loads(text), "Tools")
    except ValueError as e:  # json's errors are ValueErrors too
        raise gr.Error(f"Tools: {e}" if isinstance(e, json.JSONDecodeError) else str(e))


def fit_prompt(tok, context: int, messages: list[dict], max_tokens: int, default: int,
               tools: list[dict] | None = None) -> tuple[list[int], int, int]:
    """The prompt for `messages` and the reply's budget: (ids, max_tokens for the reply, messages dropped).

    max_tokens 0, the page's default, is what the context leaves after the prompt (up to the model's own
    `default`, generation.json's): the history keeps its turns until the reply would have under a quarter
    of the context (the default model's replies to the examples above are 9 to 32 tokens, 32 being a
    quarter of its context), and only then do the oldest leave. A budget the user sets keeps its own room
    for the reply (model.chat.history_budget's rule, as in the terminal)."""
    ids, _, dropped = fit_history(tok, messages, history_budget(context, max_tokens or context // 4), tools)
    room = max(context - len(ids), 0)
    return ids, min(max_tokens or default, room), dropped


async def respond(app: FastAPI, message, history, system_prompt, tools_json, temperature, top_k, max_tokens, replies):
    """One chat turn of the page (its inputs in the page's order): yields (the reply's messages so far, the
    replies' parts kept), the reply streamed as it is generated."""
    runtime = app.state.runtime
    if runtime is None:
        raise gr.Error("The model is still loading; try again in a moment.")
    replies = dict(replies or {})
    functions = read_tools(tools_json)
    messages = to_messages(message, history, system_prompt, replies)
    answered = [FunctionCall(c.text, messages[-1]["content"]) for c in called(messages[-2])] \
        if messages[-1]["role"] == "tool" else []
    try:
        prompt, budget, dropped = fit_prompt(runtime.tokenizer, runtime.context_len, messages,
                                             int(max_tokens), runtime.defaults["max_tokens"], functions)
    except ChatFormatError as e:
        raise gr.Error(str(e))
    if len(prompt) >= runtime.context_len:
        raise gr.Error(f"The message is {len(prompt)} tokens, over the model's context of "
                       f"{runtime.context_len}. Shorten it.")
    if dropped:
        gr.Info(f"The conversation outgrew the model's context of {runtime.context_len} tokens: the model "
                f"sees it without its {dropped} oldest messages.")
    params = runtime.sampling(temperature=temperature, top_k=int(top_k), max_tokens=budget)
    try:
        stream = await runtime.open_stream(prompt, params)
    except (QueueFull, EngineStopped) as e:
        raise gr.Error(f"The server is busy ({e}); try again shortly.")
    words, calls = "", stream.reader.function_calls
    async for piece in stream:  # closing this generator (stop button) cancels the stream
        words += piece
        yield reply_messages(words, stream.tool_uses, calls=calls, answered=answered), replies
    shown = reply_messages(words, stream.tool_uses, done=True, calls=calls, answered=answered)
    replies[turn_key(_shown_texts(shown))] = stream.parts
    yield shown, replies


def build_ui(app: FastAPI) -> gr.Blocks:
    settings = app.state.settings
    described = describe_model_dir(settings.model_dir)
    gen, context = described["generation"], int(described["config"].get("seq_len", 1024))

    # respond's own parameters by name: the page's API (/gradio_api/call/v2/respond) takes them as keywords
    async def chat(message, history, system_prompt, tools_json, temperature, top_k, max_tokens, replies):
        turn = respond(app, message, history, system_prompt, tools_json, temperature, top_k, max_tokens, replies)
        try:
            async for out in turn:
                yield out
        finally:  # the stop button closes this generator: close the turn now, which cancels its stream
            await turn.aclose()

    with gr.Blocks(title="sparkchat", fill_height=True) as page:
        replies = gr.State({})
        gr.ChatInterface(
            chat,
            api_name="respond",  # the page's API endpoint keeps its name (the function here is `chat`)
            title="sparkchat",
            description=model_line(settings.model_dir),
            textbox=gr.Textbox(placeholder="Message sparkchat", show_label=False, scale=7, autofocus=True,
                               submit_btn=True, stop_btn=True),
            examples=[[e] for e in EXAMPLES],
            additional_inputs=[
                gr.Textbox(label="System prompt", value="", lines=2, render=False),
                gr.Textbox(label=TOOLS_LABEL, value="", lines=3, render=False,
                           placeholder='[{"type": "function", "function": {"name": "get_weather", "parameters": '
                                       '{"type": "object", "properties": {"city": {"type": "string"}}}}}]'),
                gr.Slider(0.0, 2.0, value=gen["temperature"], step=0.05, label="Temperature", render=False),
                gr.Slider(0, 200, value=gen["top_k"], step=1, label="Top-k (0: off)", render=False),
                gr.Slider(0, context, value=0, step=1, render=False,
                          label=f"Max tokens (0: what the context leaves, up to {gen['max_tokens']}; the model's "
                                f"context: {context})"),
                replies,
            ],
            additional_outputs=[replies],
            additional_inputs_accordion=gr.Accordion("Settings: system prompt, tools, sampling", open=False,
                                                     render=False),
            stop_btn=True,
            fill_height=True,
        )
    return page


def _client_error(exc: BaseException) -> tuple[int, str] | None:
    """(status, reason) when Gradio failed on what a client sent, not on a fault of its own: an unknown
    endpoint, function, event or session, or data of a shape its code did not expect (raised inside
    gradio's own code); None for anything else, which stays a 500 with its traceback."""
    cause = exc.__cause__ if isinstance(exc, RuntimeError) else None  # Starlette: "response already started"
    for e in (exc, cause):
        if isinstance(e, HTTPException) and e.status_code < 500:
            return e.status_code, str(e.detail)
    if isinstance(exc, FnIndexInferError):
        return 404, str(exc)
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    in_gradio = tb is not None and any(f"/{package}/" in tb.tb_frame.f_code.co_filename
                                       for package in ("gradio", "gradio_client"))
    if in_gradio and isinstance(exc, (KeyError, IndexError)):
        return 404, f"unknown {exc}"
    if in_gradio and isinstance(exc, (TypeError, ValueError, AttributeError)):
        return 400, f"malformed call: {exc}"
    return None


# the calls that carry a function's inputs as a list `data`: by API name (call: the simple format, which
# may leave out inputs hidden from the API) or by index (queue/join, the page's own)
DATA_CALL = re.compile(rf"^{API_PREFIX}/(?:(call|run|api)/([^/]+)|queue/join)/?$")
# the event streams: a call's by its event id, the page's by its session
EVENT_STREAM = re.compile(rf"^{API_PREFIX}/(?:call/[^/]+/([^/]+)|queue/data)/?$")


def data_count_error(page: gr.Blocks, path: str, body: bytes) -> str | None:
    """Why a call's `data` does not fit its function, by count; None when it does, or when the call is
    not one to judge here (Gradio's own checks refuse it). Gradio itself fails on too few values only
    once the call runs (a 500, or an error event after a 200) and drops extra ones."""
    m = DATA_CALL.match(path)
    try:
        call = json.loads(body) if m else None
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("data"), list):
        return None
    if m.group(2) is None:
        index = call.get("fn_index")
        fn = page.fns.get(index) if isinstance(index, int) else None
    else:
        fn = next((f for f in page.fns.values() if f.api_name == m.group(2)), None)
    if fn is None:
        return None
    counts = {len(fn.inputs)}
    if m.group(1) == "call":
        counts.add(len([b for b in fn.inputs if not b.skip_api]))
    if len(call["data"]) in counts:
        return None
    return (f"`data` holds {len(call['data'])} value{'s' * (len(call['data']) != 1)}, and "
            f"{fn.api_name or fn.name} takes {' or '.join(map(str, sorted(counts)))}")


def unknown_stream(page: gr.Blocks, path: str, query: str) -> str | None:
    """What an event stream names that the queue does not hold (Gradio's own test, made before its
    stream starts: it answers such a stream 200 and then an error event); None when it holds it, or when
    the request names none (Gradio refuses that itself)."""
    m = EVENT_STREAM.match(path)
    queue = page._queue
    if m and m.group(1) is not None:
        event_id = m.group(1)
        event = queue.event_ids_to_events.get(event_id)
        session = event.session_hash if event is not None else next(
            (s for s, ids in queue.pending_event_ids_session.items() if event_id in ids), event_id)
        return None if session in queue.pending_messages_per_session else f"unknown event id {event_id!r}"
    session = parse_qs(query).get("session_hash", [None])[0] if m else None
    if session is None or session in queue.pending_messages_per_session:
        return None
    return f"unknown session {session!r}"


class GradioGuard:
    """ASGI middleware over the chat page's own API (/gradio_api/...), for logged-in calls: one whose
    `data` does not fit its function gets a 400 saying so before Gradio sees it (data_count_error), an
    event stream of an unknown event or session a 404 (unknown_stream). A call that Gradio fails on with
    a client's mistake (_client_error) is answered with a 4xx and the reason, logged in one line,
    instead of a 500 and a traceback. Gradio's app answers 500 itself before the error reaches here, so
    a 500's start is held until its body comes or the error does. A reply already begun (an event
    stream) just ends."""

    def __init__(self, app, gradio_app):
        self.app, self.gradio = app, gradio_app

    def _logged_in(self, scope) -> bool:
        """Whether Gradio lets this call in (its own get_current_user's test): a call that it would refuse
        with 401 is left to it, so that nothing about the page's functions is told before the login."""
        g = self.gradio
        if g.auth is None and g.auth_dependency is None:
            return True
        cookies = Request(scope).cookies
        token = cookies.get(f"access-token-{g.cookie_id}") or cookies.get(f"access-token-unsecure-{g.cookie_id}")
        return g.tokens.get(token) is not None

    async def _data_checked(self, scope, receive, send):
        """The call's body read whole, its `data` checked, then replayed to Gradio; None: refused."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        why = data_count_error(self.gradio.get_blocks(), scope["path"], body)
        if why is not None:
            log.info("refused a chat page call to %s with 400: %s", scope["path"], why)
            await error_response(400, f"The call to {scope['path']} was refused: {why}")(scope, receive, send)
            return None
        return replayed(body, receive)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX + "/"):
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and DATA_CALL.match(scope["path"]) and self._logged_in(scope):
            receive = await self._data_checked(scope, receive, send)
            if receive is None:
                return
        if scope["method"] == "GET" and EVENT_STREAM.match(scope["path"]) and self._logged_in(scope):
            why = unknown_stream(self.gradio.get_blocks(), scope["path"], scope["query_string"].decode("latin-1"))
            if why is not None:
                log.info("refused a chat page call to %s with 404: %s", scope["path"], why)
                return await error_response(404, f"The call to {scope['path']} was refused: {why}")(scope, receive, send)
        started, held = False, []  # held: a 500's messages

        async def watched(message):
            nonlocal started
            if held or (message["type"] == "http.response.start" and message["status"] == 500):
                held.append(message)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def flush():
            for message in held:
                await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            refusal = _client_error(e)
            if refusal is None:
                await flush()
                raise
            status, why = refusal
            log.info("refused a chat page call to %s with %d: %s", scope["path"], status, why)
            if not started:
                await error_response(status, f"The call to {scope['path']} was refused: {why}")(scope, receive, send)
        else:
            await flush()


def mount_ui(app: FastAPI, settings) -> gr.Blocks:
    """The chat page at / of `app`; the page."""
    auth = None
    if settings.api_key:
        key = settings.api_key
        auth = lambda _user, password: hmac.compare_digest(str(password), key)  # noqa: E731
    page = build_ui(app)
    gr.mount_gradio_app(app, page, path="/", auth=auth,
                        auth_message="Log in with any user name and the server's API key as the password.",
                        footer_links=[], ssr_mode=False)
    # Gradio's queue looks for new jobs every millisecond while it has none (Linux; 50 ms on Windows), and
    # for progress to send every 10 ms: over a thousand wake-ups a second of an idle page, on the loop
    # every API stream shares. QUEUE_POLL_S is Gradio's own job poll on Windows: a chat turn that waits that
    # long to start is not seen. Gradio has no public setting for either.
    page._queue.sleep_when_free = page._queue.progress_update_sleep_when_free = QUEUE_POLL_S
    app.add_middleware(GradioGuard, gradio_app=next(r.app for r in app.routes if isinstance(r, Mount) and r.path == ""))
    return page
