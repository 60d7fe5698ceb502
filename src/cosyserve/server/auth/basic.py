"""HTTP Basic authentication against users with scrypt-hashed passwords."""

import base64
import binascii
import hashlib
from collections.abc import Iterable

from cosyserve.server.auth.keys import HashedSecret, VerifiedCache, hash_secret


class BasicUsers:
    """Users and their password hashes. :meth:`verify` is blocking (scrypt): run it in a
    thread. An unknown user costs the same hash as a known one, so response times do not
    tell which user names exist."""

    def __init__(self, entries: Iterable[tuple[str, HashedSecret]]) -> None:
        self._users = dict(entries)
        log2_n = max((h.log2_n for h in self._users.values()), default=10)
        self._decoy = HashedSecret.parse(hash_secret("decoy", log2_n=log2_n))
        self._cache = VerifiedCache()

    def __len__(self) -> int:
        return len(self._users)

    def verify(self, user: str, password: str) -> str | None:
        """``user`` if the password is right, else None."""
        fingerprint = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        if self._cache.get(fingerprint) == user:
            return user
        stored = self._users.get(user)
        ok = (stored or self._decoy).matches(password)
        if stored is None or not ok:
            return None
        self._cache.put(fingerprint, user)
        return user


def parse_basic(value: str) -> tuple[str, str] | None:
    """(user, password) of a Basic credential's base64 part, or None if malformed."""
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep and user else None
