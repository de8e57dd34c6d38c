"""Function calling on /v1/chat/completions (and, through `ToolFields`, /v1/responses: serve/responses.py):
`tools`, `tool_choice`, `parallel_tool_calls`, the `tool_calls` of a reply and the `tool` messages that
bring their results back.

The functions render into the prompt as compact signatures (model.tools). `tool_choice`:
  - "auto" (the default with tools): the model decides, as it learned to (the synthetic tool-use task);
  - "none": the model sees the tools but cannot call one (<|call_start|> is banned by logit bias);
  - "required": the reply is one or more calls (one, with `parallel_tool_calls: false`) of the given
    functions, each with arguments valid against its schema: a grammar (model.grammar.tool_call_grammar)
    constrains the sampler;
  - {"type": "function", "function": {"name": ...}}: one call of that function, constrained the same way.

A reply's calls come back as `message.tool_calls` (finish_reason "tool_calls"); streamed, as one delta per
call in OpenAI's shape (index, id, type, function name and arguments) before the choice's last chunk.
An assistant message sent back with `tool_calls` renders its calls as the model wrote them; each `tool`
message must answer a call of an earlier assistant message (`tool_call_id`), else a 400 naming it.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Optional, Union

from model.grammar import GrammarError, check_schema, tool_call_grammar
from model.tools import call_text, has_tools, parse_call

from pydantic import TypeAdapter, ValidationError

from .errors import APIError
from .schemas import ChatCompletionRequest, NamedToolChoice, ToolCallOut, ToolDef

MAX_BIAS_BAN = -100.0  # OpenAI's logit_bias value that bans a token


@dataclass
class ToolFields:
    """A request's function-calling fields in chat's form (the Responses API's flat forms converted), and the
    names its errors give: where a tool's parameters are (`tools[i]` + params_path) and its format's field."""
    tools: Optional[list[ToolDef]]
    tool_choice: Union[str, NamedToolChoice, None]
    parallel_tool_calls: Optional[bool]
    response_format: object = None  # a structured output asked beside (a forced call cannot have one)
    format_field: str = "response_format"
    params_path: str = ".function.parameters"
    logit_bias: Optional[dict[int, float]] = None

    @classmethod
    def of_chat(cls, req: ChatCompletionRequest) -> "ToolFields":
        return cls(req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format,
                   logit_bias=req.bias())


def check(req: ToolFields, runtime) -> None:
    """The tool fields' rules beyond their schema."""
    if req.tools is None:
        if req.tool_choice is not None and req.tool_choice != "none":
            raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice", "invalid_value")
        if req.parallel_tool_calls is not None:
            raise APIError(400, "parallel_tool_calls is only allowed when tools are given", "parallel_tool_calls",
                           "invalid_value")
        return
    if not has_tools(runtime.tokenizer):
        raise APIError(400, "This model was not trained for function calling (its tokenizer has no tool tokens)",
                       "tools", "unsupported_parameter")
    problem = functions_problem(req.tools, "tools", req.params_path)
    if problem is not None:
        raise APIError(400, *problem, "invalid_value")
    names = [t.function.name for t in req.tools]
    if not isinstance(req.tool_choice, (str, type(None))) and req.tool_choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function '{req.tool_choice.function.name}', which is not one of "
                            f"the tools ({', '.join(names)})", "tool_choice", "invalid_value")
    if forced(req) and req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, f"{req.format_field} cannot be combined with a tool_choice that forces a call",
                       req.format_field, "invalid_value")
    grammar(req, runtime)


def functions_problem(tools: list[ToolDef], field: str, params_path: str = ".function.parameters"
                      ) -> tuple[str, str] | None:
    """(message, the field it names) when the definitions cannot be offered together: a name given twice,
    parameters that are not a schema the grammar engine takes; None when they can."""
    names = [t.function.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        return f"{field}: the function name '{dup}' is given twice", field
    for i, t in enumerate(tools):
        try:
            check_schema(t.function.parameters or {"type": "object"}, f"{field}[{i}]{params_path}")
        except GrammarError as e:
            return str(e), f"{field}[{i}]{params_path}"
    return None


def parse_definitions(raw, field: str) -> list[dict]:
    """A front end's tools (the chat page's box, the terminal's --tools file): a JSON list of OpenAI `tools`
    entries, checked as the API checks them, as model.tools renders them ({"name", "parameters"}). Raises
    ValueError naming `field` (and the entry)."""
    try:
        tools = TypeAdapter(list[ToolDef]).validate_python(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        raise ValueError(f"{field}{where}: {err['msg']}") from None
    problem = functions_problem(tools, field)
    if problem is not None:
        raise ValueError(problem[0])
    return [{"name": t.function.name, "parameters": t.function.parameters} for t in tools]


def functions(req: ToolFields) -> list[dict] | None:
    """The tools as model.tools renders them ({"name", "parameters"})."""
    return None if not req.tools else [{"name": t.function.name, "parameters": t.function.parameters} for t in req.tools]


def forced(req: ToolFields) -> bool:
    return bool(req.tools) and req.tool_choice not in (None, "auto", "none")


def grammar(req: ToolFields, runtime) -> str | None:
    """The grammar of a forced call (required or named), checked; None when the model decides."""
    if not forced(req):
        return None
    chosen = [t.function for t in req.tools if req.tool_choice == "required" or t.function.name == req.tool_choice.function.name]
    s = runtime.tokenizer.special
    g = tool_call_grammar(s["<|call_start|>"], s["<|call_end|>"],
                          [(f.name, f.parameters or {"type": "object"}) for f in chosen],
                          many=req.tool_choice == "required" and req.parallel_tool_calls is not False)
    try:
        runtime.grammars.check(g)
    except GrammarError as e:
        raise APIError(400, f"Invalid schema in 'tools': {e}", "tools", "invalid_value") from None
    return g


def bias(req: ToolFields, runtime) -> dict[int, float] | None:
    """tool_choice "none" with tools: the call opener banned (added to the request's own logit_bias)."""
    own = req.logit_bias
    if req.tools and req.tool_choice == "none":
        return {**(own or {}), runtime.tokenizer.special["<|call_start|>"]: MAX_BIAS_BAN}
    return own


def message_parts(i: int, m, called: set[str]) -> dict | None:
    """An assistant message's tool_calls as call parts (its words first), or a tool message as the renderer
    takes it; None for other messages. `called`: the ids of calls so far (a tool message must answer one)."""
    if m.role == "tool":
        if m.tool_call_id is None or m.tool_call_id not in called:
            raise APIError(400, f"messages[{i}]: a tool message must answer a call of an earlier assistant message "
                                f"(tool_call_id {m.tool_call_id!r} matches none)", f"messages[{i}].tool_call_id",
                           "invalid_value")
        return {"role": "tool", "content": m.model_dump()["content"] or ""}
    if m.role != "assistant" or not m.tool_calls:
        if m.content is None:
            raise APIError(400, f"messages[{i}]: content is required (null only in an assistant message with "
                                f"tool_calls)", f"messages[{i}].content", "invalid_value")
        return None
    parts = [{"type": "text", "text": m.content}] if isinstance(m.content, str) and m.content else []
    for j, c in enumerate(m.tool_calls):
        try:
            arguments = json.loads(c.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object's text",
                           f"messages[{i}].tool_calls[{j}].function.arguments", "invalid_value")
        called.add(c.id)
        parts.append({"type": "call", "text": call_text(c.function.name, arguments)})
    return {"role": "assistant", "content": parts}


def calls(parts: list[dict]) -> list[ToolCallOut]:
    """The calls a reply made, in order (a call that is not valid JSON of a call is left out)."""
    out = []
    for p in parts:
        if p["type"] == "call" and (call := parse_call(p["text"])) is not None:
            out.append(ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}", function={
                "name": call[0], "arguments": json.dumps(call[1], ensure_ascii=False)}))
    return out
