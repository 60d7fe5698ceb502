"""Request-body size limit for every route (prompt audio uploads, JSON), as ASGI middleware.

A declared ``Content-Length`` over the limit is refused before the body is read; a
chunked body is counted as it arrives and refused once it passes the limit, so an upload
never costs more memory than the limit. Either way the answer is 413 in OpenAI's error
shape: whatever the route would answer to a body it could not read is replaced.
"""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyserve.server.error_map import PayloadTooLargeError, map_error
from cosyserve.server.http.errors import error_response


class BodySizeLimit:
    """Answers 413 to HTTP requests with a body over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = PayloadTooLargeError(f"request body larger than {self.max_bytes} bytes")
        refusal = error_response(map_error(too_large))
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await refusal(scope, receive, send)
                return
        received = 0
        exceeded = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise too_large
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                return  # the route's answer to an unreadable body; the 413 goes instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except PayloadTooLargeError:
            if not exceeded:
                raise
        if exceeded and not started:
            await refusal(scope, receive, send)
