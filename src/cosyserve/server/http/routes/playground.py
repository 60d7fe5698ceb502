"""The playground: a page at ``/`` to try the server from a browser, its assets under
``/playground/``.

The files ship in the package (``cosyserve/server/http/playground/``): plain HTML, CSS
and JavaScript, no build step and nothing fetched from elsewhere, so the page works
offline. They hold no secrets and load without a credential (:data:`PAGE_PATHS` are open
paths); the page's API calls carry the key its user types. A strict Content-Security-Policy
allows only this origin's scripts and styles (no inline code) and connections back to it.
"""

from importlib.resources import files

from fastapi import APIRouter, HTTPException, Response

router = APIRouter(include_in_schema=False)

ASSET_PREFIX = "/playground"
_PAGE = "index.html"
_ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
PAGE_PATHS = frozenset({"/", *(f"{ASSET_PREFIX}/{name}" for name in _ASSETS)})

# blob: media is the preview of a recording made in the page; nothing else leaves 'self'.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "media-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate, so a page left open in a browser picks up a server upgrade.
    "Cache-Control": "no-cache",
}


def _file(name: str, media_type: str) -> Response:
    body = files("cosyserve.server.http").joinpath("playground", name).read_bytes()
    return Response(body, media_type=media_type, headers=_HEADERS)


@router.get("/")
def page() -> Response:
    return _file(_PAGE, "text/html; charset=utf-8")


@router.get(ASSET_PREFIX + "/{name}")
def asset(name: str) -> Response:
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, "Not Found")
    return _file(name, media_type)
