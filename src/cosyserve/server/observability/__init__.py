"""Metrics, tracing and the memory watchdog of a server process."""
