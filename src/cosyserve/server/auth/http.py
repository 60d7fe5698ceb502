"""Access control for HTTP and WebSocket requests, as ASGI middleware.

It runs before routing and before the body is read: an unauthenticated request costs no
upload, no parsing and no synthesis. Failures are OpenAI-shaped JSON errors (401 with
``WWW-Authenticate``, 403, 429 with ``Retry-After``); a refused WebSocket handshake gets
the same HTTP response where the server supports denial responses, else a close with
1008 (policy violation). An admitted request runs with its
:class:`~cosyserve.server.auth.ratelimit.UsageMeter` in
:data:`~cosyserve.server.auth.ratelimit.current_usage`, and its identity in
``request.state.identity``.
"""

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from cosyserve.errors import CosyserveError
from cosyserve.server.auth.access import AccessControl
from cosyserve.server.auth.identity import AuthenticationError, Credentials
from cosyserve.server.auth.ratelimit import current_usage
from cosyserve.server.error_map import map_error
from cosyserve.server.http.errors import error_response

logger = logging.getLogger(__name__)

_VOICES_PATH = "/v1/audio/voices"
# RFC 6455 close code for a refused WebSocket when no HTTP denial response is possible.
_WS_POLICY_VIOLATION = 1008


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _manages_voices(scope: Scope) -> bool:
    path: str = scope["path"]
    return scope.get("method") in ("POST", "DELETE") and (
        path == _VOICES_PATH or path.startswith(_VOICES_PATH + "/")
    )


class AuthMiddleware:
    """Applies an :class:`AccessControl` to every HTTP and WebSocket request except its
    open paths."""

    def __init__(self, app: ASGIApp, access: AccessControl) -> None:
        self.app = app
        self.access = access
        header = access.authenticator.gateway_header
        self._gateway_header = None if header is None else header.encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.access.open_paths:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        credentials = Credentials(
            authorization=_header(scope, b"authorization"),
            gateway_identity=None if self._gateway_header is None else _header(scope, self._gateway_header),
            peer=None if client is None else str(client[0]),
        )
        try:
            meter = await self.access.admit(credentials, _manages_voices(scope))
        except CosyserveError as exc:
            await self._refuse(scope, receive, send, exc)
            return
        scope.setdefault("state", {})["identity"] = meter.identity
        token = current_usage.set(meter)
        try:
            await self.app(scope, receive, send)
        finally:
            current_usage.reset(token)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, exc: CosyserveError) -> None:
        mapped = map_error(exc)
        logger.info("refused %s %s: %s", scope["type"], scope["path"], mapped.code)
        response = error_response(mapped)
        if isinstance(exc, AuthenticationError):
            response.headers["WWW-Authenticate"] = 'Bearer realm="cosyserve"'
        if scope["type"] == "http":
            await response(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": response.status_code,
                    "headers": response.raw_headers,
                }
            )
            await send({"type": "websocket.http.response.body", "body": response.body})
        else:
            await send({"type": "websocket.close", "code": _WS_POLICY_VIOLATION})
