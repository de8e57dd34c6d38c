"""Request and response bodies of the OpenAI chat completions and completions APIs, as this server
implements them.

Field names, types and defaults follow OpenAI's API reference, strictly (`"store": 0` is not a
boolean). Unknown fields are refused (`extra="forbid"`); fields that only describe the request to the
provider (`IGNORED`: user ids, metadata, caching and storage hints) are accepted and ignored, as vLLM
does; OpenAI parameters this server does not implement are declared in `UNSUPPORTED` with their
no-op value: any other value is refused with a 400 that names the parameter. `top_k` is an extension
(as in vLLM).

`sparkchat_parts` (an extension) carries an assistant reply as the model wrote it: its words, the
calculator calls and their results, in order (model.chat's content parts). A response's
`message.content` holds the words alone (no call, no result, no `#### N` answer line); the same message
holds `sparkchat_parts` beside it (when streaming: the delta of the chunk that finishes the choice).
Send an assistant message back with both, and the server renders that turn from the parts, exactly as
the model produced it; with `content` alone it renders the words as plain text.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from model.chat import PART_TYPES
from model.requests import MAX_BIAS, MAX_LOGPROBS, MAX_PENALTY

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 8
MAX_PROMPTS = 64  # prompts in one completions request (each runs as n engine requests)


Stop = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


def whole_text(value):
    """`value`, or a ValueError if a string in it (at any depth, keys too) holds a lone surrogate: JSON's
    "\\ud800" escape parses to one, and no tokenizer, log line or reply can encode it as UTF-8."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"must be valid Unicode: character {e.start} is a lone surrogate "
                                 f"({value[e.start].encode('utf-8', 'backslashreplace').decode()}); send text as "
                                 f"UTF-8, a character above U+FFFF as a whole surrogate pair") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            whole_text(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            whole_text(k)
            whole_text(v)
    return value


class _Strict(BaseModel):
    """Every request body's base: unknown fields refused, JSON types taken as they are, numbers finite
    (Python's JSON reader takes NaN and Infinity), and text that is whole Unicode in every field."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    NOOPS: ClassVar[dict] = {}
    """Parameters declared with `_unsupported(noop)`, by name: the value at which each does nothing."""

    @field_validator("*")
    @classmethod
    def _whole_text(cls, value):
        return whole_text(value)

    def unsupported(self) -> list[str]:
        """Parameters set to something this server would have to ignore."""
        return [k for k, noop in self.NOOPS.items() if getattr(self, k) is not None and getattr(self, k) != noop]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ReplyPart(_Strict):
    """One part of an assistant reply: words (text), a calculator call (python) or its result (python_output)."""
    type: Literal[PART_TYPES]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON object's text")


class ToolCall(_Strict):
    """A function call of an assistant message sent back (as a reply's `tool_calls` gave it)."""
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer: the system prompt, as OpenAI's newer models name it; tool: a function's result")
    content: Union[str, list[TextPart], None] = Field(None, description="null or absent only in an assistant "
                                                                          "message with tool_calls")
    sparkchat_parts: Optional[list[ReplyPart]] = Field(
        None, description="extension, assistant messages only: the reply as the server returned it")
    name: Optional[str] = Field(None, description="accepted and ignored")
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant messages: the calls it made")
    tool_call_id: Optional[str] = Field(None, description="tool messages: the call this is the result of")
    # what a client sends back of a reply (the openai package's message.model_dump() has them all): null only
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Optional[Annotated[list, Field(max_length=0)]] = None


class StreamOptions(_Strict):
    include_usage: bool = False


# ---- structured outputs (serve/structured.py turns them into grammars) ----

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for schema and function names
MAX_CHOICES = 256  # guided_choice's strings


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchema(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema", description="a JSON schema (none: any JSON object)")
    strict: Optional[bool] = None


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaFormat], Field(discriminator="type")]


class FlatJSONSchemaFormat(JSONSchema):
    """The Responses API's json_schema format: the schema's fields beside `type`."""
    type: Literal["json_schema"]


TextFormatParam = Annotated[Union[TextFormat, JSONObjectFormat, FlatJSONSchemaFormat], Field(discriminator="type")]


class ResponsesText(_Strict):
    """The Responses API's `text`: its `format` (`verbosity` accepted only at its default)."""
    format: Optional[TextFormatParam] = None
    verbosity: Optional[Literal["medium"]] = None


MAX_TOOLS = 128  # OpenAI's limit on a request's tools


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: Optional[str] = Field(None, description="accepted; the model sees only the signature")
    parameters: Optional[dict] = Field(None, description="a JSON schema of the arguments object")
    strict: Optional[bool] = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


GuidedChoice = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]


# parameter -> the value at which it does nothing (the only value accepted)
NO_TOOLS = {"tools": [], "tool_choice": "none", "parallel_tool_calls": None}  # chat's and responses'
UNSUPPORTED = {
    **NO_TOOLS, "functions": [],
    "function_call": "none", "modalities": ["text"],
    "audio": None, "prediction": None, "web_search_options": None, "verbosity": None,
}
COMPLETIONS_UNSUPPORTED = {"best_of": 1, "suffix": None}


def _needs(field: str, kind: str, other: str, value) -> dict:
    """A rule across fields, in the document (JSON Schema if/then) as the server checks it: when
    `field` is given as a `kind`, `other` must be `value`."""
    return {"if": {"required": [field], "properties": {field: {"type": kind}}},
            "then": {"required": [other], "properties": {other: {"const": value}}}}


STREAM_OPTIONS_NEED_STREAM = _needs("stream_options", "object", "stream", True)


def _unsupported(noop):
    """A field the server does not implement: the document admits only its no-op value (any other
    gets a 400 naming the parameter), so clients and fuzzers see what is accepted."""
    return Field(None, json_schema_extra={"enum": [noop] if noop is None else [noop, None]},
                 description="not supported: only the value that changes nothing is accepted")
class NoTools(_Strict):
    """The tool fields of the chat and responses APIs: this server calls no tools of the client's."""
    tools: Optional[list] = _unsupported(NO_TOOLS["tools"])
    tool_choice: Union[str, dict, None] = _unsupported(NO_TOOLS["tool_choice"])
    parallel_tool_calls: Optional[bool] = _unsupported(NO_TOOLS["parallel_tool_calls"])


# accepted with any value of their type, and ignored: they change nothing a local model could do
IGNORED = ("user", "metadata", "store", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier")


class _Sampling(_Strict):
    """The sampling fields both endpoints share."""
    model: str
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0, le=2**31 - 1,
                                 description="extension: sample from the k likeliest (0: all)")
    stop: Union[Stop, Annotated[list[Stop], Field(max_length=MAX_STOP)], None] = None
    n: int = Field(1, ge=1, le=MAX_N)
    # choice i uses seed + i, so the top leaves room for MAX_N; 2**63 - 2**11 is a double exactly, so
    # tools that read JSON numbers as doubles (JSON Schema validators) agree on the bound
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 2**11)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: Optional[dict[str, float]] = Field(
        None, description=f"token id (as a string) -> bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}] added to its logit",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"},
                           "additionalProperties": {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS}})
    user: Optional[str] = None

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v):
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"keys must be token ids written as decimal strings, got {k!r}")
            if not (-MAX_BIAS <= b <= MAX_BIAS):
                raise ValueError(f"values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b} for token {k}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def bias(self) -> dict[int, float] | None:
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None


class ChatCompletionRequest(_Sampling, NoTools):
    NOOPS: ClassVar[dict] = {k: v for k, v in UNSUPPORTED.items() if k not in NO_TOOLS}
    model_config = ConfigDict(json_schema_extra={"allOf": [
        STREAM_OPTIONS_NEED_STREAM, _needs("top_logprobs", "integer", "logprobs", True)]})

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    functions: Optional[list] = _unsupported(UNSUPPORTED["functions"])
    function_call: Union[str, dict, None] = _unsupported(UNSUPPORTED["function_call"])
    response_format: Optional[ResponseFormat] = Field(None, description="text, json_object or json_schema")
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    modalities: Optional[list] = _unsupported(UNSUPPORTED["modalities"])
    audio: Optional[dict] = _unsupported(UNSUPPORTED["audio"])
    prediction: Optional[dict] = _unsupported(UNSUPPORTED["prediction"])
    web_search_options: Optional[dict] = _unsupported(UNSUPPORTED["web_search_options"])
    verbosity: Optional[str] = _unsupported(UNSUPPORTED["verbosity"])
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


class CompletionRequest(_Sampling):
    NOOPS: ClassVar[dict] = COMPLETIONS_UNSUPPORTED
    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM]})

    prompt: Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]] = Field(
        description="text, texts, token ids, or lists of token ids (a text prompt starts after <|bos|>, as a "
                    "document did in pretraining; token ids are used as given)")
    max_tokens: Optional[int] = Field(None, ge=0, description="0: no completion, only the prompt (with echo)")
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    guided_regex: Optional[str] = Field(None, description="extension (vLLM's): the completion matches this regex")
    guided_choice: Optional[GuidedChoice] = Field(None, description="extension (vLLM's): the completion is one of these")
    guided_json: Optional[dict] = Field(None, description="extension (vLLM's): the completion is JSON valid "
                                                          "against this schema")
    best_of: Optional[int] = _unsupported(COMPLETIONS_UNSUPPORTED["best_of"])
    suffix: Optional[str] = _unsupported(COMPLETIONS_UNSUPPORTED["suffix"])

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


# ---- responses ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None
    sparkchat_parts: list[ReplyPart] = Field(description="extension: the reply with its calculator use")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None
    refusal: Optional[list[TokenLogprob]] = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    sparkchat_parts: Optional[list[ReplyPart]] = None  # extension: in the delta that finishes a choice
    tool_calls: Optional[list[ToolCallDelta]] = None

    @model_serializer
    def _present_only(self):  # OpenAI sends {"role": ..., "content": ""}, {"content": ...}, then {}
        fields = (("role", self.role), ("content", self.content),
                  ("tool_calls", self.tool_calls and [c.model_dump() for c in self.tool_calls]),
                  ("sparkchat_parts", self.sparkchat_parts and [p.model_dump() for p in self.sparkchat_parts]))
        return {k: v for k, v in fields if v is not None}


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "tool_calls"]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: one entry per token (the echoed prompt's first, when asked; a
    prompt's first token has no logprob)."""
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparkchat"
    max_model_len: Optional[int] = None  # extension, as in vLLM


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
