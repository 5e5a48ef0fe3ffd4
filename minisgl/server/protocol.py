"""OpenAI request bodies (pydantic) and their conversion to sampling parameters.

Bodies are validated strictly from JSON: a number where a string belongs (or ``"0.5"`` where a
number belongs) is an error, unknown fields are ignored (OpenAI clients send extras), and
``null`` means "use the default". Every problem becomes a :class:`ProtocolError` naming the
field, which the API answers with a 400 in OpenAI's shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minisgl.sampling_params import INT64_MAX, INT64_MIN, MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 64
MAX_STOP_STRINGS = 64
MAX_CHOICES = 1024
"""Prompts times ``n`` in one request, at most."""

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class ProtocolError(ValueError):
    """An invalid request field; ``param`` names it the way OpenAI does (``messages[0].role``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat turn; extra keys (``name``, ``tool_calls`` ...) reach the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    seed: Int64 | None = None
    n: Int64 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None

    def _check_common(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ProtocolError(f"'n' must be between 1 and {MAX_N}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ProtocolError("'max_tokens' must be a positive integer", "max_tokens")
        stops = self.stop_list
        if len(stops) > MAX_STOP_STRINGS:
            raise ProtocolError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
        if any(not s for s in stops):
            raise ProtocolError("'stop' strings must not be empty", "stop")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        defaults = SamplingParams()

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        params = SamplingParams(
            temperature=pick(self.temperature, defaults.temperature),
            top_p=pick(self.top_p, defaults.top_p),
            top_k=pick(self.top_k, defaults.top_k),
            min_p=pick(self.min_p, defaults.min_p),
            presence_penalty=pick(self.presence_penalty, defaults.presence_penalty),
            frequency_penalty=pick(self.frequency_penalty, defaults.frequency_penalty),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            max_tokens=pick(max_tokens, defaults.max_tokens),
            min_tokens=pick(self.min_tokens, defaults.min_tokens),
            stop=self.stop_list,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            seed=self.seed,
            logprobs=logprobs,
        )
        try:
            params.validate()
        except ValueError as exc:
            text = str(exc)
            param = text.split("'")[1] if text.startswith("'") else None
            raise ProtocolError(text, param) from None
        return params

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """One copy per choice; with a seed, choice ``i`` uses ``seed + i``."""
        out = []
        for i in range(self.num_choices):
            p = SamplingParams(**{**params.__dict__, "stop": list(params.stop)})
            if params.seed is not None and i > 0:
                p.seed = params.seed + i
            out.append(p)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ProtocolError(
                "'max_completion_tokens' must be a positive integer", "max_completion_tokens"
            )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ProtocolError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ProtocolError(
                    f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs"
                )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.requested_max_tokens, logprobs)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool | None = None
    logprobs: Int64 | None = None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ProtocolError(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
        return self._params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompts to complete: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise ProtocolError("'prompt' must not be empty", "prompt")
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if len(prompts) * self.num_choices > MAX_CHOICES:
            raise ProtocolError(
                f"'prompt' times 'n' may make at most {MAX_CHOICES} completions", "prompt"
            )
        for i, item in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(item, list):
                if not item:
                    raise ProtocolError(f"'{where}' must not be an empty list of tokens", where)
                if any(t < 0 for t in item):
                    raise ProtocolError(f"'{where}' token ids must be non-negative", where)
        return prompts


class AbortRequest(_Strict):
    id: str | None = None
    rid: str | None = None


_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def _is_field(item: Any) -> bool:
    """A field name in an error location (not a union alternative's tag like ``list[int]``)."""
    return isinstance(item, str) and item.isidentifier() and item not in _TYPE_TAGS


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: tuple[Any, ...], through_unions: bool) -> str:
    """OpenAI-style field path (``messages[0].content[1].text``) of an error location.

    Union alternatives' tags are skipped when ``through_unions``; otherwise the path stops at
    the first one.
    """
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif _is_field(item):
            path += f".{item}" if path else item
        elif not through_unions:
            break
    return path


def _inside_model_alternative(loc: tuple[Any, ...]) -> bool:
    """The error sits in a field of a union alternative that is a model (a content part)."""
    tags = [i for i, item in enumerate(loc) if isinstance(item, str) and not _is_field(item)]
    return bool(tags) and any(_is_field(item) for item in loc[tags[0] + 1 :])


def parse_request(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body into ``model``; raise :class:`ProtocolError` on the first problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = next((e for e in errors if _inside_model_alternative(tuple(e["loc"]))), errors[0])
        loc = tuple(err["loc"])
        if err["type"] == "json_invalid":
            raise ProtocolError(f"the request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type" and not loc:
            raise ProtocolError("the request body must be a JSON object") from None
        specific = _inside_model_alternative(loc)
        param = _param_path(loc, through_unions=specific)
        in_union = not specific and any(not _is_field(i) and isinstance(i, str) for i in loc)
        if err["type"] == "missing":
            raise ProtocolError(f"'{param}' is a required field", param) from None
        leaf = param.rsplit(".", 1)[-1].split("[", 1)[0]
        if in_union and leaf in _UNION_HINTS:
            raise ProtocolError(f"'{param}' must be {_UNION_HINTS[leaf]}", param) from None
        raise ProtocolError(f"invalid value for '{param}': {err['msg']}", param) from None
