"""Access control for gRPC calls: an aio server interceptor.

Credentials come from the call's metadata (``authorization``, and the gateway header) and
its peer address, exactly as HTTP's come from headers; a refused call ends with
UNAUTHENTICATED, PERMISSION_DENIED or RESOURCE_EXHAUSTED (with ``retry-after`` trailing
metadata) through the one error map. The handler runs with the caller's usage meter in
:data:`~cosyserve.server.auth.ratelimit.current_usage`.
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from cosyserve.errors import CosyserveError
from cosyserve.server.auth.access import AccessControl
from cosyserve.server.auth.identity import Credentials
from cosyserve.server.auth.ratelimit import UsageMeter, current_usage
from cosyserve.server.grpc.rpc import Context, abort

if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
_VOICE_ADMIN_METHODS = ("/cosyserve.v1.Speech/AddVoice", "/cosyserve.v1.Speech/DeleteVoice")


def peer_address(peer: str) -> str | None:
    """The IP address of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or None
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies an :class:`AccessControl` to every call."""

    def __init__(self, access: AccessControl) -> None:
        self.access = access

    async def _admit(self, context: Context, method: str) -> UsageMeter:
        metadata = {key: value for key, value in context.invocation_metadata() or ()}
        gateway = self.access.authenticator.gateway_header

        def text(key: str | None) -> str | None:
            value = None if key is None else metadata.get(key)
            return value.decode("latin-1") if isinstance(value, bytes) else value

        credentials = Credentials(text("authorization"), text(gateway), peer_address(context.peer()))
        try:
            return await self.access.admit(credentials, method in _VOICE_ADMIN_METHODS)
        except CosyserveError as exc:
            await abort(context, exc, 1)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable["Handler | None"]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> "Handler | None":
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        admit = self._admit
        if handler.unary_stream is not None:
            inner_stream: Any = handler.unary_stream  # an async generator function (aio)

            async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
                token = current_usage.set(await admit(context, method))
                try:
                    async for response in inner_stream(request, context):
                        yield response
                finally:
                    current_usage.reset(token)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_unary is not None:
            inner_unary: Any = handler.unary_unary  # a coroutine function (aio)

            async def unary_unary(request: Any, context: Context) -> Any:
                token = current_usage.set(await admit(context, method))
                try:
                    return await inner_unary(request, context)
                finally:
                    current_usage.reset(token)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        # Client-streaming methods: none are served; refuse rather than pass unchecked.
        raise NotImplementedError(f"no access control for the streaming-request method {method}")
