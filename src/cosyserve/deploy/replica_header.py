"""Response headers that say where a request ran: ``x-cosyserve-replica`` (the Ray Serve
replica) and ``x-cosyserve-node`` (the Ray node, i.e. the machine), for operators reading a
client's report next to the replicas' logs."""

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "x-cosyserve-replica"
NODE_HEADER = "x-cosyserve-node"


class ReplicaHeaders:
    """Adds ``headers`` to every HTTP response."""

    def __init__(self, app: ASGIApp, headers: dict[str, str]) -> None:
        self.app = app
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in self.headers.items():
                    headers.append(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
