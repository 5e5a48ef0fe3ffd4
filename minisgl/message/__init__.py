"""Plain dataclass messages between processes, serialized with msgpack."""

from minisgl.message.backend import (
    DetokenizeMsg,
    DetokRequest,
    StatsMsg,
    StopMsg,
    TokenOutput,
    UserMsg,
)
from minisgl.message.codec import decode, encode, register
from minisgl.message.control import ConfigMsg, FailedMsg, ProgressMsg, ReadyMsg
from minisgl.message.frontend import (
    AbortMsg,
    AcceptedMsg,
    ErrorInfo,
    Reply,
    ReplyBatch,
    TokenizeMsg,
    TokenLogprob,
)

__all__ = [
    "AbortMsg",
    "AcceptedMsg",
    "ConfigMsg",
    "DetokRequest",
    "DetokenizeMsg",
    "ErrorInfo",
    "FailedMsg",
    "ProgressMsg",
    "ReadyMsg",
    "Reply",
    "ReplyBatch",
    "StatsMsg",
    "StopMsg",
    "TokenLogprob",
    "TokenOutput",
    "TokenizeMsg",
    "UserMsg",
    "decode",
    "encode",
    "register",
]
