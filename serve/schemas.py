"""Request and response bodies of the OpenAI chat completions API, as this server implements it.

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

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from model.chat import PART_TYPES

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ReplyPart(_Strict):
    """One part of an assistant reply: words (text), a calculator call (python) or its result (python_output)."""
    type: Literal[PART_TYPES]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]
    sparkchat_parts: Optional[list[ReplyPart]] = Field(
        None, description="extension, assistant messages only: the reply as the server returned it")


class StreamOptions(_Strict):
    include_usage: bool = False


# parameter -> the value at which it does nothing (the only value accepted)
UNSUPPORTED = {
    "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "top_logprobs": 0,
    "logit_bias": {}, "tools": [], "tool_choice": "none", "parallel_tool_calls": None, "functions": [],
    "function_call": "none", "response_format": {"type": "text"}, "modalities": ["text"],
    "audio": None, "prediction": None, "web_search_options": None, "verbosity": None,
}
# accepted with any value of their type, and ignored: they change nothing a local model could do
IGNORED = ("user", "metadata", "store", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier")


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0, le=2**31 - 1,
                                 description="extension: sample from the k likeliest (0: all)")
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_N)  # choice i uses seed + i
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    logit_bias: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list] = None
    function_call: Union[str, dict, None] = None
    response_format: Optional[dict] = None
    user: Optional[str] = None
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    modalities: Optional[list] = None
    audio: Optional[dict] = None
    prediction: Optional[dict] = None
    web_search_options: Optional[dict] = None
    verbosity: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> list[str]:
        """Parameters set to something this server would have to ignore."""
        return [k for k, noop in UNSUPPORTED.items()
                if getattr(self, k) is not None and getattr(self, k) != noop]


# ---- responses ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: Optional[str] = None
    sparkchat_parts: list[ReplyPart] = Field(description="extension: the reply with its calculator use")


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


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

    @model_serializer
    def _present_only(self):  # OpenAI sends {"role": ..., "content": ""}, {"content": ...}, then {}
        fields = (("role", self.role), ("content", self.content),
                  ("sparkchat_parts", self.sparkchat_parts and [p.model_dump() for p in self.sparkchat_parts]))
        return {k: v for k, v in fields if v is not None}


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
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
