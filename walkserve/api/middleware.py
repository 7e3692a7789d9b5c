"""ASGI middleware of the app: the API key, and the request count by route *template* and
status (``/v1/walks/{walk}``, never the raw path: a client cannot make new metric series or
put its own text into ``/metrics``; a path no route serves counts as ``unmatched``). Plain
ASGI (not Starlette's ``BaseHTTPMiddleware``), so that the routes see the client's disconnect
and no extra task runs per request."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from walkserve.api.errors import error_body
from walkserve.api.metrics import Metrics

UNMATCHED = "unmatched"


def route_template(routes: list[BaseRoute], scope: Scope) -> str:
    """The path template of the route that serves ``scope`` (any method), else
    ``UNMATCHED``."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", UNMATCHED))
        if match == Match.PARTIAL and partial is None:  # the path matches, the method not
            partial = str(getattr(route, "path", UNMATCHED))
    return partial or UNMATCHED


class AuthAndCount:
    """With an API key, every route but ``/health`` needs ``Authorization: Bearer KEY`` (401
    otherwise); every response is counted by route template and status."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, metrics: Metrics, routes: list[BaseRoute]
    ) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_template(self.routes, scope)
        if self.expected is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.metrics.count(route, 401)
                response = JSONResponse(
                    error_body(
                        "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        "authentication_error",
                    ),
                    401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.count(route, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
