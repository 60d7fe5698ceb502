"""HTTP error responses: every error on every route becomes OpenAI's error JSON.

The status codes and messages come from :mod:`cosyserve.server.error_map`; this module only
turns them into Starlette responses and installs the handlers on an app.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cosyserve.errors import CosyserveError
from cosyserve.server.error_map import MappedError, http_error, map_error, validation_error

logger = logging.getLogger(__name__)


def error_response(error: MappedError) -> JSONResponse:
    return JSONResponse(error.openai_body(), status_code=error.http_status, headers=error.http_headers())


def install_error_handlers(app: FastAPI) -> None:
    """Map cosyserve errors, schema errors, routing errors and unexpected exceptions."""

    async def on_cosyserve_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(map_error(exc))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(describe_validation_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return error_response(http_error(exc.status_code, str(exc.detail)))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response, and the server logs the traceback.
        return error_response(map_error(exc, log=False))

    app.add_exception_handler(CosyserveError, on_cosyserve_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def describe_validation_error(exc: RequestValidationError) -> MappedError:
    """One line naming the first offending field; never the submitted value."""
    errors = exc.errors()
    if not errors:
        return validation_error("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return validation_error("the request body is not valid JSON")
    # loc is ("body" | "query" | ..., field, ...); the field path is what a client knows.
    path = [str(part) for part in first.get("loc", ())[1:]]
    field = ".".join(path)
    message = f"{field}: {first.get('msg', 'invalid value')}" if field else str(first.get("msg", "invalid"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return validation_error(message, param=field or None)
