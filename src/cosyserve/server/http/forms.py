"""Form bodies (multipart uploads, url-encoded fields) with stable 400s for malformed ones.

The body size is limited for every route by :class:`~cosyserve.server.http.body_limit.BodySizeLimit`
(413 past ``max_upload_bytes``); here a body that is not a form, or not a well-formed one,
becomes an :class:`~cosyserve.errors.InvalidRequestError` instead of parser text.
"""

from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request

from cosyserve.errors import InvalidRequestError

_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


async def read_form(request: Request) -> FormData:
    """The request's form fields and files; an empty form for a request without a body
    (upstream's GET requests may carry their fields in the query string instead)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type not in _FORM_TYPES:
        if _has_body(request):
            raise InvalidRequestError(
                "unsupported content type; send multipart/form-data or application/x-www-form-urlencoded"
            )
        return FormData()
    try:
        return await request.form(max_files=4, max_fields=32)
    except HTTPException:  # Starlette's answer to a malformed multipart body
        raise InvalidRequestError("malformed form body") from None


async def read_upload(form: FormData, name: str) -> bytes | None:
    """The bytes of the file field ``name`` (None if absent or empty)."""
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, UploadFile):
        raise InvalidRequestError(f"{name} must be a file upload")
    return await value.read() or None


def text_field(form: FormData, request: Request, name: str, max_chars: int) -> str:
    """The text field ``name`` from the form, else from the query string ("" if absent)."""
    value = form.get(name)
    if value is None:
        value = request.query_params.get(name, "")
    if isinstance(value, UploadFile):
        raise InvalidRequestError(f"{name} must be a text field, not a file")
    if len(value) > max_chars:
        raise InvalidRequestError(f"{name} is too long (at most {max_chars} characters)")
    return value


def _has_body(request: Request) -> bool:
    declared = request.headers.get("content-length")
    if declared is not None:
        return declared.strip() not in ("", "0")
    return "transfer-encoding" in request.headers
