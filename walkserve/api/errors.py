"""The error shape of every HTTP answer that is not a success, as the OpenAI API has it::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_k", "code": null}}

``ApiError`` is raised anywhere below a route and turned into that body with its status by the
app's exception handler; ``param`` names the request field at fault where one is."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers
        self.param = param


class ClientGone(ApiError):
    """The client disconnected before its (non-streamed) answer was ready."""

    def __init__(self) -> None:
        super().__init__(499, "the client disconnected", "client_closed_request")


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 for the client to fix (``param``: the field at fault)."""
    return ApiError(400, message, param=param)


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
