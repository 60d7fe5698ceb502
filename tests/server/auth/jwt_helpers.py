"""RSA keys, JWKS documents and tokens for the auth tests (generated, never stored)."""

import json
import time
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

ISSUER = "https://issuer.test"
AUDIENCE = "cosyserve"


@dataclass(frozen=True)
class SigningKey:
    kid: str
    private: rsa.RSAPrivateKey

    def jwk(self) -> dict[str, Any]:
        public: dict[str, Any] = json.loads(RSAAlgorithm.to_jwk(self.private.public_key()))
        return {**public, "kid": self.kid, "use": "sig", "alg": "RS256"}

    def token(self, sub: str = "alice", expires_in: float = 600, **claims: Any) -> str:
        now = int(time.time())
        payload = {"sub": sub, "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + int(expires_in)}
        payload.update(claims)
        return jwt.encode(payload, self.private, algorithm="RS256", headers={"kid": self.kid})


def new_key(kid: str) -> SigningKey:
    return SigningKey(kid, rsa.generate_private_key(public_exponent=65537, key_size=2048))


def jwks(*keys: SigningKey) -> str:
    return json.dumps({"keys": [k.jwk() for k in keys]})
