"""API keys stored as salted scrypt hashes, and the hash format shared with HTTP Basic.

A stored secret reads ``scrypt$<log2 n>$<r>$<p>$<salt b64>$<hash b64>`` (what
``cosyserve auth hash-key`` prints): the parameters travel with the hash, so they can be
raised later without invalidating old entries. Comparisons use :func:`hmac.compare_digest`.

scrypt is slow on purpose (tens of milliseconds), so a key that verified once is
remembered by its SHA-256 digest (never the key itself) in a bounded per-process cache;
callers run verification off the event loop.
"""

import base64
import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from cosyserve.server.settings import SettingsError

SCHEME = "scrypt"
DEFAULT_LOG2_N = 14  # n = 16384, r = 8: 16 MiB and ~40 ms per check, OWASP's minimum
_SALT_BYTES = 16
_HASH_BYTES = 32
_CACHE_ENTRIES = 4096


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


@dataclass(frozen=True)
class HashedSecret:
    """One stored secret: scrypt parameters, salt and derived hash."""

    log2_n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @classmethod
    def parse(cls, encoded: str) -> "HashedSecret":
        """Raises :class:`ValueError` for anything but a well-formed scrypt entry."""
        parts = encoded.strip().split("$")
        if len(parts) != 6 or parts[0] != SCHEME:
            raise ValueError("not a scrypt$... hash (make one with `cosyserve auth hash-key`)")
        log2_n, r, p = (int(v) for v in parts[1:4])
        if not (1 <= log2_n <= 20 and 1 <= r <= 32 and 1 <= p <= 16):
            raise ValueError("scrypt parameters out of range")
        return cls(log2_n, r, p, _unb64(parts[4]), _unb64(parts[5]))

    def derive(self, secret: str) -> bytes:
        return hashlib.scrypt(
            secret.encode("utf-8"),
            salt=self.salt,
            n=1 << self.log2_n,
            r=self.r,
            p=self.p,
            maxmem=256 * 1024 * 1024,
            dklen=len(self.digest),
        )

    def matches(self, secret: str) -> bool:
        return hmac.compare_digest(self.derive(secret), self.digest)

    def encode(self) -> str:
        return f"{SCHEME}${self.log2_n}${self.r}${self.p}${_b64(self.salt)}${_b64(self.digest)}"


def hash_secret(secret: str, log2_n: int = DEFAULT_LOG2_N, r: int = 8, p: int = 1) -> str:
    """The stored form of ``secret`` with a fresh random salt."""
    salt = secrets.token_bytes(_SALT_BYTES)
    stub = HashedSecret(log2_n, r, p, salt, b"\0" * _HASH_BYTES)
    return HashedSecret(log2_n, r, p, salt, stub.derive(secret)).encode()


def new_api_key() -> str:
    """A random API key (256 bits, URL-safe)."""
    return "csk_" + secrets.token_urlsafe(32)


def parse_entries(text: str, what: str) -> list[tuple[str, HashedSecret]]:
    """``name:hash`` entries, separated by commas or newlines; ``#`` starts a comment line.
    Raises :class:`SettingsError` naming the bad entry's position (never its content)."""
    entries: list[tuple[str, HashedSecret]] = []
    items = [
        i.strip() for line in text.splitlines() if not line.lstrip().startswith("#") for i in line.split(",")
    ]
    for number, item in enumerate((i for i in items if i), start=1):
        name, sep, encoded = item.partition(":")
        if not sep or not name.strip():
            raise SettingsError(f"{what} entry {number} is not name:hash")
        try:
            entries.append((name.strip(), HashedSecret.parse(encoded)))
        except ValueError as exc:
            raise SettingsError(f"{what} entry {number} ({name.strip()}): {exc}") from None
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        raise SettingsError(f"{what}: a name appears twice")
    return entries


class VerifiedCache:
    """Names of secrets that verified recently, by SHA-256 of the presented secret (LRU)."""

    def __init__(self, size: int = _CACHE_ENTRIES) -> None:
        self._size = size
        self._entries: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> str | None:
        with self._lock:
            name = self._entries.get(key)
            if name is not None:
                self._entries.move_to_end(key)
            return name

    def put(self, key: bytes, name: str) -> None:
        with self._lock:
            self._entries[key] = name
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)


class ApiKeys:
    """Named API keys. :meth:`verify` is blocking (scrypt); run it in a thread."""

    def __init__(self, entries: Iterable[tuple[str, HashedSecret]]) -> None:
        self._entries = tuple(entries)
        self._cache = VerifiedCache()

    def __len__(self) -> int:
        return len(self._entries)

    def verify(self, key: str) -> str | None:
        """The name of the entry ``key`` matches, or None."""
        if not key:
            return None
        fingerprint = hashlib.sha256(key.encode("utf-8")).digest()
        name = self._cache.get(fingerprint)
        if name is not None:
            return name
        for entry_name, stored in self._entries:
            if stored.matches(key):
                self._cache.put(fingerprint, entry_name)
                return entry_name
        return None
