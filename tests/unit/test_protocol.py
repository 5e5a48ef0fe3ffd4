"""OpenAI request validation: strict types, named fields, sampling-parameter mapping."""

from __future__ import annotations

import json

import pytest

from minisgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    parse_request,
)


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def completion(**fields: object) -> CompletionRequest:
    body = {"model": "m", "prompt": "hi", **fields}
    return parse_request(CompletionRequest, json.dumps(body).encode())


def error_of(fn, **fields: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        req = fn(**fields)
        req.sampling_params()
        if isinstance(req, CompletionRequest):
            req.prompts()
    return info.value


def test_defaults_and_mapping() -> None:
    req = chat(
        temperature=0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        max_completion_tokens=7,
        max_tokens=99,
        stop="END",
        stop_token_ids=[2],
        seed=11,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
        user="someone",
        tools=None,
        response_format={"type": "text"},
    )
    p = req.sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 0.5, 3, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.max_tokens == 7, "max_completion_tokens wins over max_tokens"
    assert p.stop == ["END"] and p.stop_token_ids == [2] and p.seed == 11
    assert p.ignore_eos and p.logprobs == 3
    defaults = chat().sampling_params()
    assert defaults.temperature == 1.0 and defaults.logprobs is None and defaults.stop == []
    assert chat().requested_max_tokens is None
    nulls = chat(temperature=None, stop=None, n=None, seed=None).sampling_params()
    assert nulls.temperature == 1.0 and nulls.seed is None


def test_choices_get_consecutive_seeds() -> None:
    req = chat(n=3, seed=5, stop=["x"])
    params = req.choice_params(req.sampling_params())
    assert [p.seed for p in params] == [5, 6, 7]
    params[0].stop.append("y")
    assert params[1].stop == ["x"], "choices must not share mutable fields"
    unseeded = chat(n=2)
    assert [p.seed for p in unseeded.choice_params(unseeded.sampling_params())] == [None, None]


def test_message_shapes() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        ]
    )
    msgs = req.template_messages()
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == [{"type": "text", "text": "a"}]
    assert msgs[2] == {"role": "assistant", "tool_calls": [{"id": "1"}]}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"n": 2.0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 2**70}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"top_k": 2**70}, "top_k"),
        ({"stop_token_ids": [1, 2**70]}, "stop_token_ids[1]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "x" * 99, "text": "a"}]}]},
            "messages[0].content[0].type",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "text": "a"}]}]},
            "messages[0].content[0].type",
        ),
        ({"model": 3}, "model"),
    ],
)
def test_chat_errors_name_the_field(fields: dict, param: str) -> None:
    err = error_of(chat, **fields)
    assert err.param == param, err.message
    assert param.split("[")[0].split(".")[0] in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [[1], [-2]]}, "prompt"),
        ({"prompt": [5, 2**70]}, "prompt"),
        ({"prompt": ["a"] * 2000, "n": 64}, "prompt"),
        ({"prompt": ["a"] * 5000}, "prompt"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 30}, "logprobs"),
        ({"echo": 1}, "echo"),
    ],
)
def test_completion_errors_name_the_field(fields: dict, param: str) -> None:
    assert error_of(completion, **fields).param == param


def test_missing_prompt() -> None:
    with pytest.raises(ProtocolError, match="'prompt' is a required field") as info:
        parse_request(CompletionRequest, b'{"model": "m"}')
    assert info.value.param == "prompt"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"", b'"text"'])
def test_bodies_that_are_not_objects(body: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(ChatCompletionRequest, body)
    assert info.value.param is None


def test_prompt_forms() -> None:
    assert completion(prompt="abc").prompts() == ["abc"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    req = completion(logprobs=2, echo=True, stream=True, stream_options={"include_usage": True})
    assert req.sampling_params().logprobs == 2 and req.echo and req.include_usage


def test_nan_is_rejected() -> None:
    req = parse_request(
        ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}'
    )
    with pytest.raises(ProtocolError) as info:
        req.sampling_params()
    assert info.value.param == "top_p"
