"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from minisgl.message import ErrorInfo

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """Raised anywhere in request handling; the app turns it into the matching response."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")

    @classmethod
    def from_info(cls, info: ErrorInfo) -> ApiError:
        return cls(info.status, info.message, info.code, info.param, info.type)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def overloaded(message: str = "the server is overloaded; retry later") -> ApiError:
    return ApiError(503, message, code="server_overloaded")


def unavailable(message: str, code: str = "service_unavailable") -> ApiError:
    return ApiError(503, message, code=code)
