"""A Hugging Face Hub stand-in on loopback: the few routes ``snapshot_download`` uses.

``GET /api/models/<repo>[/revision/<rev>]`` (model info), ``GET /api/models/<repo>/tree/<rev>``
(the file listing with sizes, git blob ids and LFS sha256), and ``HEAD``/``GET
/<repo>/resolve/<rev>/<path>`` (ETag, sizes, commit headers; ``Range`` for resumes). Files
are served from disk. Faults are injected per path: ``cut_once`` sends only the first N
bytes of the next full GET and drops the connection; ``fail`` answers GETs with 500;
``corrupt`` serves one flipped byte (the listing keeps the true checksums).
"""

import hashlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Files at least this large are LFS files on the fake hub (as weights are on the real one).
LFS_MIN_BYTES = 100_000


@dataclass
class HubState:
    repo: str
    files: Mapping[str, Path]
    cut_once: dict[str, int] = field(default_factory=dict)
    fail: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    entries: dict[str, dict[str, object]] = field(default_factory=dict)

    def gets(self, path: str) -> list[str | None]:
        """The Range header of every GET of ``path`` so far."""
        with self.lock:
            return [r for method, p, r in self.requests if method == "GET" and p == path]

    def entry(self, path: str) -> dict[str, object]:
        """The tree listing's item for ``path`` (computed once)."""
        if path not in self.entries:
            self.entries[path] = self._entry(path)
        return self.entries[path]

    def _entry(self, path: str) -> dict[str, object]:
        data = self.files[path].read_bytes()
        blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
        item: dict[str, object] = {"type": "file", "path": path, "size": len(data), "oid": blob}
        if len(data) >= LFS_MIN_BYTES:
            item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return item


def _handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    info = re.compile(rf"^/api/models/{re.escape(state.repo)}(/revision/[^/]+)?$")
    tree = re.compile(rf"^/api/models/{re.escape(state.repo)}/tree/[^/]+$")
    resolve = re.compile(rf"^/{re.escape(state.repo)}/resolve/[^/]+/(.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            if info.match(path):
                siblings = [{"rfilename": name} for name in sorted(state.files)]
                self._json({"id": state.repo, "sha": COMMIT, "siblings": siblings, "private": False})
            elif tree.match(path):
                self._json([state.entry(name) for name in sorted(state.files)])
            elif (match := resolve.match(path)) and match.group(1) in state.files:
                self._file(match.group(1), body)
            else:
                self.send_error(404)

        def _json(self, payload: object) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, name: str, body: bool) -> None:
            requested = self.headers.get("Range")
            with state.lock:
                state.requests.append(("GET" if body else "HEAD", name, requested))
                failing = body and name in state.fail
                cut = state.cut_once.pop(name, None) if body and requested is None else None
            if failing:
                self.send_error(500)
                return
            data = state.files[name].read_bytes()
            entry = state.entry(name)
            lfs = entry.get("lfs")
            etag = lfs["oid"] if isinstance(lfs, dict) else entry["oid"]
            if body and name in state.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = int(re.fullmatch(r"bytes=(\d+)-", requested).group(1)) if body and requested else 0  # type: ignore[union-attr]
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("ETag", f'"{etag}"')
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            if isinstance(lfs, dict):
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if cut is not None:
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler


@contextmanager
def fake_hub(repo: str, files: Mapping[str, Path]) -> Iterator[tuple[str, HubState]]:
    """Serve ``files`` (repo path -> local file) as ``repo`` on 127.0.0.1; yields the
    endpoint URL and the state (faults, request log). Stopped on exit."""
    state = HubState(repo, dict(files))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
