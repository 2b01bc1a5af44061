"""Typed chat/completions requests, after OpenAI's schema: a request is parsed here before it
touches a session, the chat template or the engine, so every bad field is a SessionError
(a 4xx from the server) that names the field, in OpenAI's form ("messages.[0].role").

Types are strict, as OpenAI's are ("5" is not an integer, 1 is not a string). Every request
field is honoured, refused, or ignored because it cannot change the reply (`HARMLESS`, each
with its reason); a field rlexp does not know is refused, since it may change the reply
(docs/agents.md lists them all)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from annotated_types import Ge, Le
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlexp.constraints import AtLeast1, NonNegative, TopP
from rlexp.errors import SessionError

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request, as OpenAI allows
Request = TypeVar("Request", bound=BaseModel)
Seed = Annotated[int, Ge(-(2**63)), Le(2**63 - 1)]  # a signed 64-bit integer, as vLLM takes


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str
    detail: Literal["auto"] | None = None  # "low"/"high" would change the reply: the processor decides
    _image: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _opens(self) -> ImageURL:
        from rlexp.chat.images import load_image_url

        self._image = load_image_url(self.url)
        return self


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL

    def for_template(self) -> dict[str, Any]:
        return {"type": "image", "image": self.image_url._image}


class ImagePart(_Model):
    """A PIL image, from an in-process client (an agent's prompt); JSON cannot hold one."""

    model_config = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True)
    type: Literal["image"]
    image: Any

    @field_validator("image")
    @classmethod
    def _a_picture(cls, image):
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError("an 'image' part holds a PIL image (in process); over HTTP, send an "
                             "'image_url' part with a data URL or a local path")
        return image

    def for_template(self) -> dict[str, Any]:
        return {"type": "image", "image": self.image}


Part = Annotated[TextPart | ImageURLPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    model_config = ConfigDict(strict=True, extra="allow")  # chat templates may read other keys

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None
    content: str | list[Part] | None = Field(None, validate_default=True)
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _has_content(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if content is None and role is not None and not (role == "assistant" and info.data.get("tool_calls")):
            raise ValueError(f"a message with role {role!r} needs 'content'")
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: content as one string, never missing;
        with images, its parts, each image part `{"type": "image", "image": <PIL image>}`."""
        out = self.model_dump(exclude_none=True, exclude={"content"})
        content = self.content or ""
        if isinstance(content, str):
            out["content"] = content
        elif any(p.type != "text" for p in content):
            out["content"] = [p.for_template() if p.type != "text" else p.model_dump() for p in content]
        else:
            out["content"] = "".join(p.text for p in content if isinstance(p, TextPart))
        return out


class Function(_Model):  # its own keys: a tool spec is data, not a request field
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: Function


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


Stop = Annotated[str, Field(min_length=1)]


# Accepted and not used: none of them changes what is generated (why, per field).
HARMLESS = {
    "user": "an end-user id for the provider's abuse monitoring",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "metadata": "tags the provider stores with a completion",
    "store": "whether the provider keeps the completion; the session records it anyway",
    "service_tier": "the provider's latency/price tier",
    "prompt_cache_key": "a routing hint for the provider's prompt cache",
    "prompt_cache_retention": "how long the provider's prompt cache keeps a prefix",
    "prediction": "predicted output: speeds a provider up, never changes the output",
    "logprobs": "the sampled tokens' logprobs are always returned (they are the training data)",
}
Penalty = Annotated[float, Ge(-2), Le(2)]
Bias = Annotated[float, Ge(-100), Le(100)]


class StreamOptions(_Model):
    include_usage: bool | None = None


class _Sampling(_Model):
    model: str | None = None
    max_tokens: AtLeast1 | None = None
    temperature: Annotated[NonNegative, Le(2)] | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None  # token id (as a string, OpenAI's JSON) -> bias
    # the harmless fields, typed loosely: they are not read
    user: Any = None
    safety_identifier: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prediction: Any = None

    stream_options: StreamOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when 'stream' is true")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"{key!r} is not a token id")
        return bias

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop


class JSONSchemaFormat(_Model):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("type 'json_schema' goes with a 'json_schema' object, and only it")
        return self


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: AtLeast1 | None = None
    n: Annotated[int, Ge(1), Le(MAX_N)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # false: at most one call per reply (a forced call is one; under "auto" the reply ends after
    # its first call, rlexp/chat/reply_end.py)
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Ge(0), Le(20)] | None = None
    session_id: str | None = None

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, choice, info: ValidationInfo):
        names = [t.function.name for t in info.data.get("tools") or []]
        if choice == "required" and not names:
            raise ValueError("tool_choice='required' needs 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"it names {choice.function.name!r}, which is not in 'tools'")
        return choice

    @property
    def forced_tools(self) -> list[str] | None:
        """Tool names the reply must call, from `tool_choice`; None = free choice."""
        if self.tool_choice == "required":
            return [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [self.tool_choice.function.name]
        return None


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Ge(0)]], Field(min_length=1)]
    n: Annotated[int, Ge(1), Le(MAX_N)] | None = None
    logprobs: Annotated[int, Ge(0), Le(5)] | None = None  # the completions API's: alternatives per token
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None
    session_id: Any = None  # harmless: completions are not session-tracked


class TokenizeRequest(_Model):
    messages: list[Message] | None = Field(None, min_length=1)
    prompt: Annotated[str, Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None  # counted as a chat request with these tools would be
    session_id: Any = None  # harmless: counting tokens touches no session

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give one of 'messages' or 'prompt'")
        return self


def _param(error: Any, body: Any) -> str | None:
    """pydantic's error location in OpenAI's form ("messages.[0].role"), keeping only the
    steps that exist in the body (pydantic also names the union branch it tried)."""
    parts, value, loc = [], body, error["loc"]
    for i, step in enumerate(loc):
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            value = value[step]
            parts.append(step)
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            value = value[step]
            parts.append(f"[{step}]")
        elif i == len(loc) - 1 and isinstance(value, dict) and (error["type"] == "missing"
                                                                  or error.get("input") is None):
            parts.append(str(step))
    return ".".join(parts) or None


def parse(model: type[Request], body: Any, model_name: str | None = None) -> Request:
    """`body` as a `model`, or a SessionError naming the first bad field; a request for a model
    other than `model_name` is a 404 model_not_found, as OpenAI and vLLM answer."""
    if not isinstance(body, dict):
        raise SessionError("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        # Of the errors (one per union branch tried), the one deepest into the body, and
        # a broken constraint rather than a wrong type ("at most 4 items", not "a string").
        errors = [(_param(err, body), err) for err in e.errors(include_url=False)]
        param, first = max(errors, key=lambda pe: (len(pe[0] or ""), not pe[1]["type"].endswith("_type")))
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "not a field rlexp knows; refused, since it may change the reply"
        raise SessionError(f"{param}: {message}" if param else message, param=param) from None
    name = getattr(request, "model", None)
    if model_name is not None and name is not None and name != model_name:
        raise SessionError(f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", status=404, code="model_not_found")
    return request
