"""OpenAI's Responses API (`POST /v1/responses`) for text: its bodies and its logic.

A request is a conversation: `input` is a string (one user message) or a list of messages, each with a
role (user, assistant, system, or developer: the system prompt, as is `instructions`) and its content as
a string or as text parts (`input_text`, or the `output_text` parts of a response's output sent back).
It renders with the training renderer, as chat completions do, and runs as one engine request through
`Runtime.open_stream`. The reply is one output message holding one `output_text` part (the assistant's
words; a calculator use shows as in chat completions' `content`: its words only). The response's status is
"completed", or "incomplete" (reason `max_output_tokens`) when the token budget or the context ended it.

Function calling as chat completions have it (serve/tool_calls.py, through `ToolFields`), in the Responses
API's shapes: `tools` entries {"type": "function", "name", "parameters"}, `tool_choice` "none", "auto",
"required" or {"type": "function", "name"}, `parallel_tool_calls`. Each call the reply makes is an output
item {"type": "function_call", "call_id", "name", "arguments"} after the message (which is left out when
the reply is only calls); sent back in `input` with a {"type": "function_call_output", "call_id", "output"}
item, the output renders as the call's result. Streamed, a call is response.output_item.added,
response.function_call_arguments.delta and .done, then response.output_item.done, once the call is whole.

With `stream`, the reply comes as the events OpenAI sends, each an SSE `event:` line and its JSON with a
`sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per piece of text), response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or response.incomplete,
or response.failed when the engine failed). Nothing is stored: `store` is accepted and ignored (as vLLM
does by default), and `previous_response_id` is refused; send the conversation in `input`.

Sampling takes `temperature`, `top_p` and `max_output_tokens`; the other fields follow schemas.py's
rules: fields that describe the request to a provider are ignored, features this server lacks accept
only the value that changes nothing, and any other field is a 400 that names it.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Annotated, AsyncIterator, Callable, ClassVar, Literal, Optional, Union

from fastapi import Request
from pydantic import BaseModel, Field

from model.chat import ChatFormatError, content_text
from model.tools import call_text

from . import serving, tool_calls
from .errors import APIError
from .runtime import Runtime, TextStream
from .sse import Last
from .schemas import (MAX_TOOLS, FunctionDef, FunctionName, NamedToolChoice, ResponsesText, ToolDef,
                      _Strict, _unsupported)
from .structured import format_grammar

# parameter -> the value at which it does nothing (the only value accepted; schemas.py's rule)
NOOPS = {"previous_response_id": None,
         "conversation": None, "background": False, "reasoning": None,
         "include": [], "top_logprobs": 0, "max_tool_calls": None, "prompt": None, "truncation": "disabled"}


class TextPart(_Strict):
    """A message's text: `input_text`, or an `output_text` part of an earlier response sent back."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[Annotated[list, Field(max_length=0)]] = None
    logprobs: Optional[list] = Field(None, description="accepted and ignored (an output_text sent back)")


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = Field(
        description="system and developer: the system prompt (only first, and not with `instructions`)")
    content: Union[str, Annotated[list[TextPart], Field(min_length=1)]]
    id: Optional[str] = Field(None, description="accepted and ignored (an output message sent back)")
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A call of an earlier response, sent back (its output item as given)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON object's text")
    id: Optional[str] = Field(None, description="accepted and ignored")
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionCallOutputItem(_Strict):
    """A call's result, for the call of an earlier input item with this `call_id`."""
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: Optional[str] = Field(None, description="accepted and ignored")
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionTool(FunctionDef):
    """A Responses tool: chat's function definition with its `type` beside its fields, not around them."""
    type: Literal["function"]


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    NOOPS: ClassVar[dict] = NOOPS

    model: str
    input: Union[str, Annotated[list[Union[InputMessage, FunctionCallItem, FunctionCallOutputItem]],
                                Field(min_length=1)]]
    tools: Optional[Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    instructions: Optional[str] = Field(None, description="the system prompt")
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    # accepted with any value of their type, and ignored: they change nothing a local model could do
    stream_options: Optional[dict] = None
    metadata: Optional[dict[str, str]] = Field(None, description="returned as given")
    store: Optional[bool] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    previous_response_id: Optional[str] = _unsupported(NOOPS["previous_response_id"])
    conversation: Union[str, dict, None] = _unsupported(NOOPS["conversation"])
    background: Optional[bool] = _unsupported(NOOPS["background"])
    reasoning: Optional[dict] = _unsupported(NOOPS["reasoning"])
    text: Optional[ResponsesText] = Field(None, description="format: text, json_object or json_schema")
    include: Optional[list] = _unsupported(NOOPS["include"])
    top_logprobs: Optional[int] = _unsupported(NOOPS["top_logprobs"])
    max_tool_calls: Optional[int] = _unsupported(NOOPS["max_tool_calls"])
    prompt: Optional[dict] = _unsupported(NOOPS["prompt"])
    truncation: Optional[str] = _unsupported(NOOPS["truncation"])

    def tool_fields(self) -> tool_calls.ToolFields:
        """The function-calling fields in chat's form, for serve/tool_calls.py."""
        tools = None if self.tools is None else [
            ToolDef(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                          parameters=t.parameters, strict=t.strict)) for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        return tool_calls.ToolFields(tools, choice, self.parallel_tool_calls, self.text and self.text.format,
                                     "text.format", ".parameters")

    def messages(self) -> list[dict]:
        """The conversation for the renderer: `instructions` first, as the system prompt. A function_call item
        joins the assistant turn before it (a response's message and calls come back as items in a row)."""
        turns = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        msgs = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        called: set[str] = set()
        for i, m in enumerate(turns):
            if isinstance(m, FunctionCallItem):
                try:
                    arguments = json.loads(m.arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise APIError(400, f"input[{i}].arguments must be a JSON object's text", f"input[{i}].arguments")
                called.add(m.call_id)
                part = {"type": "call", "text": call_text(m.name, arguments)}
                if msgs and msgs[-1]["role"] == "assistant":
                    last = msgs[-1]
                    if isinstance(last["content"], str):
                        last["content"] = [{"type": "text", "text": last["content"]}] if last["content"] else []
                    last["content"].append(part)
                else:
                    msgs.append({"role": "assistant", "content": [part]})
                continue
            if isinstance(m, FunctionCallOutputItem):
                if m.call_id not in called:
                    raise APIError(400, f"input[{i}]: a function_call_output must answer a function_call of an earlier "
                                        f"input item (call_id {m.call_id!r} matches none)", f"input[{i}].call_id")
                msgs.append({"role": "tool", "content": m.output})
                continue
            system = m.role in ("system", "developer")
            if system and (msgs or i):
                where = "with `instructions`" if self.instructions is not None else "after the first message"
                raise APIError(400, f"input[{i}]: a {m.role} message {where}: this model takes one system prompt, "
                                    f"before the conversation (`instructions`, or the first input message)",
                               f"input[{i}].role")
            msgs.append({"role": "system" if system else m.role, "content": m.text()})
        return msgs


# ---- the response ----

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A call the reply made, as an output item."""
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: dict[str, str] = {}
    model: str
    output: list[Union[OutputMessage, FunctionCallOutput]] = []
    parallel_tool_calls: bool = False
    store: bool = False  # nothing is stored, whatever the request asked
    temperature: float
    top_p: float
    text: dict = {"format": {"type": "text"}}
    tool_choice: Union[Literal["none", "auto", "required"], dict] = "none"
    tools: list[dict] = []
    truncation: Literal["disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None


# ---- logic ----

def check(req: ResponsesRequest, runtime: Runtime) -> list[int]:
    """Everything the schema cannot say; returns the prompt ids."""
    serving.check_supported(req, runtime)
    format_grammar(req.text and req.text.format, runtime, "text.format")  # a bad schema: a 400 before any work
    fields = req.tool_fields()
    tool_calls.check(fields, runtime)
    messages = req.messages()
    serving.check_length(runtime, runtime.fewest_tokens(content_text(m["content"]) for m in messages), "input",
                         "at least ")
    try:
        ids = runtime.render(messages, tool_calls.functions(fields))
    except ChatFormatError as e:
        raise APIError(400, str(e), "input") from None
    serving.check_length(runtime, len(ids), "input")
    return ids


class _Run:
    """One response in the making: its engine stream and what the response object says of it."""

    def __init__(self, req: ResponsesRequest, runtime: Runtime, prompt: list[int]):
        fields = req.tool_fields()
        grammar = tool_calls.grammar(fields, runtime) or format_grammar(req.text and req.text.format, runtime,
                                                                         "text.format")
        try:
            self.params = runtime.sampling(req.temperature, None, req.top_p, req.max_output_tokens, grammar=grammar,
                                           logit_bias=tool_calls.bias(fields, runtime))
        except ValueError as e:  # a value out of range
            raise APIError(400, str(e)) from None
        self.stream: TextStream | None = None
        self.req, self.runtime, self.prompt = req, runtime, prompt
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._calls: list[FunctionCallOutput] | None = None

    async def submit(self) -> "_Run":
        """Submit now, so a full queue or a prompt the engine refuses is an HTTP error, not a broken stream."""
        self.stream = (await serving.open_streams(self.runtime, [(self.prompt, self.params)], [], "input"))[0]
        return self

    @property
    def status(self) -> str:
        reason = self.stream.finish_reason
        return "in_progress" if reason is None else {"length": "incomplete", "error": "failed"}.get(reason, "completed")

    def calls(self) -> list[FunctionCallOutput]:
        """The reply's calls as output items (once it is whole; made once, so every event names the same ids)."""
        if self._calls is None:
            self._calls = [FunctionCallOutput(id=f"fc_{uuid.uuid4().hex}", call_id=c.id, name=c.function.name,
                                              arguments=c.function.arguments)
                           for c in tool_calls.calls(self.stream.parts)]
        return self._calls

    def message(self, text: str | None) -> OutputMessage:
        status = "in_progress" if text is None else "completed" if self.status == "completed" else "incomplete"
        return OutputMessage(id=self.message_id, status=status, content=[] if text is None else [OutputText(text=text)])

    def output(self, text: str) -> list:
        """The message (left out when the reply is only calls), then the calls."""
        calls = self.calls()
        return ([self.message(text)] if text or not calls else []) + calls

    def response(self, text: str | None = None) -> ResponseObject:
        """The response object; before the reply's `text` is whole (None), as the stream's first events show it."""
        s, status = self.stream, self.status if text is not None else "in_progress"
        done = status != "in_progress"
        req = self.req
        return ResponseObject(
            id=self.id, created_at=self.created, status=status, model=self.runtime.model_id,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {}, temperature=self.params.temperature, top_p=self.params.top_p,
            text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text and req.text.format else {"format": {"type": "text"}},
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            tool_choice=(req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionToolChoice)
                         else req.tool_choice or ("auto" if req.tools else "none")),
            parallel_tool_calls=bool(req.tools) and req.parallel_tool_calls is not False,
            output=self.output(text) if done else [],
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=ResponseError(message="The model failed while generating (the server's log says why)")
            if status == "failed" else None,
            usage=ResponseUsage(input_tokens=len(self.prompt), output_tokens=s.completion_tokens,
                                total_tokens=len(self.prompt) + s.completion_tokens) if done else None)


async def complete(req: ResponsesRequest, runtime: Runtime, prompt: list[int], raw: Request) -> ResponseObject:
    run = await _Run(req, runtime, prompt).submit()
    text, = await serving.collect([run.stream], raw)
    return run.response(text)


async def stream(req: ResponsesRequest, runtime: Runtime,
                 prompt: list[int]) -> tuple[AsyncIterator[str], Callable[[], None]]:
    """Open the stream now (so errors become HTTP errors), then return the SSE event iterator and what
    cancels the stream."""
    run = await _Run(req, runtime, prompt).submit()
    numbers = itertools.count()
    where = {"item_id": run.message_id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields) -> str:
        """One SSE event; json.dumps of a small dict (a delta is the per-token line: no pydantic object)."""
        body = json.dumps({"type": kind, "sequence_number": next(numbers), **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {body}\n\n"

    def snapshot(text: str | None = None) -> dict:
        return run.response(text).model_dump(mode="json")

    def opened() -> str:
        """The message's first events: sent with its first words (a reply of calls alone has none)."""
        return (event("response.output_item.added", output_index=0, item=run.message(None).model_dump(mode="json"))
                + event("response.content_part.added", **where, part=OutputText(text="").model_dump()))

    def call_events(index: int, call: FunctionCallOutput) -> str:
        started = call.model_copy(update={"status": "in_progress", "arguments": ""}).model_dump(mode="json")
        at = {"item_id": call.id, "output_index": index}
        return (event("response.output_item.added", output_index=index, item=started)
                + event("response.function_call_arguments.delta", **at, delta=call.arguments)
                + event("response.function_call_arguments.done", **at, name=call.name, arguments=call.arguments)
                + event("response.output_item.done", output_index=index, item=call.model_dump(mode="json")))

    async def events():
        yield event("response.created", response=snapshot()) + event("response.in_progress", response=snapshot())
        pieces = []
        async for piece in run.stream:
            if piece:  # "" marks a calculator use or a function call: its words come as text, its call at the end
                first = "" if pieces else opened()
                pieces.append(piece)
                yield first + event("response.output_text.delta", **where, delta=piece, logprobs=[])
        text = "".join(pieces)
        final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(run.status,
                                                                                              "response.failed")
        calls, closing = run.calls(), ""
        if text or not calls:  # the message, whole (opened now if no words came)
            closing = (("" if pieces else opened())
                       + event("response.output_text.done", **where, text=text, logprobs=[])
                       + event("response.content_part.done", **where, part=OutputText(text=text).model_dump())
                       + event("response.output_item.done", output_index=0,
                               item=run.message(text).model_dump(mode="json")))
        first = 1 if text or not calls else 0
        closing += "".join(call_events(first + j, c) for j, c in enumerate(calls))
        yield Last(closing + event(final, response=snapshot(text)))

    return events(), run.stream.cancel
