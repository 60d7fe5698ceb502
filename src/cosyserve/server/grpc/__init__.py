"""gRPC transport: upstream CosyVoice's service (unchanged proto) and ``cosyserve.v1.Speech``."""

from cosyserve.server.grpc.config import GrpcConfig
from cosyserve.server.grpc.server import start_grpc_server

__all__ = ["GrpcConfig", "start_grpc_server"]
