"""Inter-process plumbing: msgpack message round trips (nothing else gets through), socket dirs."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from minisgl.message import (
    AbortMsg,
    AcceptedMsg,
    ConfigMsg,
    DetokenizeMsg,
    DetokRequest,
    ErrorInfo,
    FailedMsg,
    ReadyMsg,
    Reply,
    ReplyBatch,
    StatsMsg,
    StopMsg,
    TokenizeMsg,
    TokenLogprob,
    TokenOutput,
    UserMsg,
    decode,
    encode,
    register,
)
from minisgl.sampling_params import SamplingParams

SAMPLES = [
    TokenizeMsg(
        rids=["a-0", "a-1"],
        params=[SamplingParams(temperature=0.0, stop=["\n\n"], seed=3), SamplingParams(seed=4)],
        messages=[{"role": "user", "content": [{"type": "text", "text": "héllo ✓"}]}],
        fill_max_tokens=True,
    ),
    TokenizeMsg(rids=["b"], params=[SamplingParams()], input_ids=[1, 2, 3], echo=True),
    AbortMsg(["x", "y"]),
    UserMsg("r", [5, 6, 7], SamplingParams(max_tokens=3, logprobs=2), skip_special_tokens=False),
    StopMsg(["r"]),
    DetokenizeMsg(
        new=[DetokRequest("r", ["END"], True, True)],
        outputs=[
            TokenOutput("r", [9], [-0.5], [[(9, -0.5), (4, -1.25)]], False, None, None, 3, 1),
            TokenOutput("q", [], None, None, True, "error", "too long", 9, 0),
        ],
    ),
    StatsMsg(1, 2, 1000, 900, 50, 30, 20, 7),
    AcceptedMsg("r", 12, None),
    ReplyBatch(
        [
            Reply("r", "Paris", 1, [TokenLogprob(7, "Paris", -0.1, [("Paris", -0.1)])]),
            Reply("q", finished=True, finish_reason="error", error=ErrorInfo("bad", 400)),
        ]
    ),
    ReadyMsg("scheduler-0", {"max_seq_len": 8192, "model_path": "/m"}),
    FailedMsg("tokenizer", "Traceback ..."),
    ConfigMsg("/m", 8192, 49152),
]


def _normalized(obj: object) -> object:
    """Tuples become lists on the wire; compare with that in mind."""
    if dataclasses.is_dataclass(obj):
        return (type(obj).__name__, {k: _normalized(v) for k, v in vars(obj).items()})
    if isinstance(obj, list | tuple):
        return [_normalized(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _normalized(v) for k, v in obj.items()}
    return obj


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    back = decode(encode(msg))
    assert type(back) is type(msg)
    assert _normalized(back) == _normalized(msg)


def test_nested_types_are_rebuilt() -> None:
    back = decode(encode(SAMPLES[0]))
    assert all(isinstance(p, SamplingParams) for p in back.params)
    assert back.params[0].stop == ["\n\n"] and back.params[1].seed == 4
    batch = decode(encode(SAMPLES[8]))
    assert isinstance(batch.replies[0].logprobs[0], TokenLogprob)
    assert isinstance(batch.replies[1].error, ErrorInfo)


def test_user_maps_cannot_impersonate_messages() -> None:
    sneaky = {"__m": "UserMsg", "rid": "x"}
    msg = TokenizeMsg(rids=["a"], params=[SamplingParams()], messages=[sneaky])
    assert decode(encode(msg)).messages == [sneaky]


def test_unregistered_classes_are_refused() -> None:
    @dataclasses.dataclass
    class Secret:
        x: int

    with pytest.raises(TypeError, match="not a registered message"):
        encode(Secret(1))
    with pytest.raises(TypeError):
        encode(object())


def test_unknown_or_malformed_data_is_a_value_error() -> None:
    payload = msgpack.packb(["NoSuchMessage", [1]], use_bin_type=True)
    with pytest.raises(ValueError, match="unknown message type"):
        decode(msgpack.packb(msgpack.ExtType(7, payload)))
    with pytest.raises(ValueError, match="unknown msgpack extension"):
        decode(msgpack.packb(msgpack.ExtType(3, b"")))
    wrong_arity = msgpack.packb(["AbortMsg", [["a"], "extra"]], use_bin_type=True)
    with pytest.raises(ValueError, match="expects 1 fields"):
        decode(msgpack.packb(msgpack.ExtType(7, wrong_arity)))
    with pytest.raises(ValueError):
        decode(b"\xc1")


def test_register_rejects_a_second_class_with_the_same_name() -> None:
    @dataclasses.dataclass
    class AbortMsg:  # noqa: F811 - deliberately clashes with the real one
        rids: list[str]

    with pytest.raises(ValueError, match="already registered"):
        register(AbortMsg)
    with pytest.raises(TypeError, match="not a dataclass"):
        register(int)


def test_api_side_imports_stay_light() -> None:
    """The API process must not pay for torch: messages and the app import without it."""
    import subprocess
    import sys

    code = (
        "import sys, minisgl.message, minisgl.server.api, minisgl.server.launcher;"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_socket_dirs_record_their_owner_and_stale_ones_are_removed(tmp_path, monkeypatch) -> None:
    import os
    import tempfile

    from minisgl.server.ipc import OWNER_FILE, IpcPaths

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess_pid_that_exited()
    stale = tmp_path / "minisgl-stale"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(str(dead))
    foreign = tmp_path / "minisgl-no-owner"
    foreign.mkdir()
    paths = IpcPaths.create()
    assert not stale.exists() and foreign.exists()
    assert (tmp_path / os.path.basename(paths.root) / OWNER_FILE).read_text() == str(os.getpid())
    assert paths.addr("api") == f"ipc://{paths.root}/api"
    IpcPaths.create()
    assert os.path.isdir(paths.root), "a live launcher's directory is kept"
    paths.remove()
    assert not os.path.exists(paths.root)


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
