"""Serving: the speech service and its transports (HTTP, WebSocket, gRPC)."""
