"""Chat templating, prompt encoding and message validation against the default model."""

from __future__ import annotations

import pytest

from minisgl.tokenizer import encode_chat, encode_text, load_tokenizer, render_chat


@pytest.fixture(scope="session")
def model_path():
    from minisgl.models.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tok(model_path):
    return load_tokenizer(model_path)


def chatml(*turns: tuple[str, str], generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def test_load_tokenizer_missing_dir(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_tokenizer(tmp_path / "nope")


def test_chat_template_is_chatml(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    expected = chatml(("system", "Be brief."), ("user", "What is the capital of France?"))
    assert render_chat(tok, messages) == expected
    ids = encode_chat(tok, messages)
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == expected
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == im_start
    assert ids.count(im_start) == 3
    assert ids.count(im_end) == 2


def test_chat_without_system_and_multi_turn(tok):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.decode(encode_chat(tok, messages), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(chatml(("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")))


def test_no_generation_prompt(tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tok.decode(encode_chat(tok, messages, add_generation_prompt=False), False)
    assert text == chatml(("system", "S"), ("user", "U"), generation_prompt=False)


def test_text_parts_joined_and_developer_is_system(tok):
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    messages = [
        {"role": "developer", "content": "Rules"},
        {"role": "user", "content": parts},
    ]
    assert encode_chat(tok, messages) == encode_chat(
        tok, [{"role": "system", "content": "Rules"}, {"role": "user", "content": "Hello, world"}]
    )


def test_assistant_tool_calls_without_content(tok):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    text = render_chat(tok, messages)
    assert text == chatml(("system", "S"), ("user", "U"), ("assistant", ""), ("tool", "42"))


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        (None, "must be a list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role must be one of"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            r"messages\[1\]\.role must be one of system, user, assistant, tool, developer",
        ),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string or a list"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be"),
        ([{"role": "assistant", "content": None}], r"messages\[0\]\.content must be"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"messages\[0\]\.content\[0\]\.type 'image_url' is not supported",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
            r"messages\[0\]\.content\[1\]\.text must be a string",
        ),
        ([{"role": "user", "content": ["plain"]}], r"messages\[0\]\.content\[0\] must be"),
    ],
)
def test_invalid_messages(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(tok, messages)


def test_fallback_chatml_without_template(model_path):
    bare = load_tokenizer(model_path)
    bare.chat_template = None
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(bare, messages) == chatml(("user", "Hi"))
    assert render_chat(bare, messages, add_generation_prompt=False) == chatml(
        ("user", "Hi"), generation_prompt=False
    )
    assert encode_chat(bare, messages) == bare.encode(
        chatml(("user", "Hi")), add_special_tokens=False
    )


@pytest.mark.parametrize("text", ["Hello", "The capital of France is", " 世界 🤖 naïve", ""])
def test_encode_text_roundtrip(tok, text):
    ids = encode_text(tok, text)
    assert ids == tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_encode_text_rejects_non_string(tok):
    with pytest.raises(ValueError, match="prompt must be a string"):
        encode_text(tok, [1, 2, 3])
