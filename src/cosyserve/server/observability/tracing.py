"""Optional OpenTelemetry tracing: spans when ``opentelemetry`` is installed, else no-ops.

cosyserve only creates spans (through the global tracer provider); exporting them is the
deployment's choice (e.g. ``opentelemetry-instrument cosyserve serve`` with an OTLP
exporter). Without the package, :func:`span` costs one function call.
"""

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

_TRACER_NAME = "cosyserve"


def _tracer() -> Any:
    try:
        trace = importlib.import_module("opentelemetry.trace")
    except ImportError:
        return None
    return trace.get_tracer(_TRACER_NAME)


@contextlib.contextmanager
def span(name: str, **attributes: str | int | float | bool) -> Iterator[None]:
    """A span around the ``with`` body (no-op without OpenTelemetry)."""
    tracer = _tracer()
    if tracer is None:
        yield
        return
    with tracer.start_as_current_span(name, attributes=attributes):
        yield
