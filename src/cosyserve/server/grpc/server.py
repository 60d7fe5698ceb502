"""The gRPC server: upstream's ``cosyvoice.CosyVoice`` and our ``cosyserve.v1.Speech`` on
one port, both over the process's :class:`~cosyserve.server.service.SpeechService`."""

import logging
from collections.abc import Sequence

import grpc

from cosyserve.server.grpc.config import GrpcConfig
from cosyserve.server.grpc.protos import cosyserve_v1_pb2_grpc, cosyvoice_pb2_grpc
from cosyserve.server.grpc.servicer_upstream import UpstreamServicer
from cosyserve.server.grpc.servicer_v1 import SpeechServicer
from cosyserve.server.service import SpeechService

logger = logging.getLogger(__name__)


async def start_grpc_server(
    service: SpeechService,
    host: str,
    port: int,
    config: GrpcConfig | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> grpc.aio.Server:
    """Start serving on ``host:port`` (insecure; put TLS in front) and return the running
    server; the caller stops it (``await server.stop(grace)``). Call from the event loop
    the server will run on. ``interceptors`` run on every call (authentication, say).

    Raises ``OSError`` if the address cannot be bound.
    """
    config = config or GrpcConfig()
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Responses are audio chunks; a whole non-streamed file can be large.
        ("grpc.max_send_message_length", -1),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    cosyvoice_pb2_grpc.add_CosyVoiceServicer_to_server(UpstreamServicer(service, config), server)
    cosyserve_v1_pb2_grpc.add_SpeechServicer_to_server(SpeechServicer(service, config), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # how grpcio reports a failed bind (in use, bad address)
        await server.stop(None)
        raise OSError(f"cannot listen for gRPC on {address}") from None
    await server.start()
    logger.info("gRPC listening on %s:%d", host, bound)
    return server
