"""The HTTP and WebSocket transport: the app factory, its routes and wire models."""
