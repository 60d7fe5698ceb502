"""A trusted gateway's identity header (an authenticating reverse proxy, a service mesh).

The header is believed only on connections from the configured gateway addresses or
networks; from anyone else it is ignored (a client could set it to any name).
"""

import ipaddress
from collections.abc import Iterable

from cosyserve.server.settings import SettingsError

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Identities become log fields and rate-limit keys: keep them short and printable.
_MAX_IDENTITY_CHARS = 256


class Gateway:
    """``header``: the identity header's name. ``trusted``: addresses or CIDR networks."""

    def __init__(self, header: str, trusted: Iterable[str]) -> None:
        self.header = header.strip().lower()
        networks: list[_Network] = []
        for entry in trusted:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise SettingsError(
                    f"auth_gateway_trusted: {entry.strip()!r} is not an address or network"
                ) from None
        if not self.header or not networks:
            raise SettingsError("a gateway needs both auth_gateway_header and auth_gateway_trusted")
        self.networks = tuple(networks)

    def trusts(self, peer: str | None) -> bool:
        if peer is None:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.networks)

    def identity(self, value: str | None, peer: str | None) -> str | None:
        """The identity the header names, if the peer is a trusted gateway and the value is
        usable; else None."""
        if value is None or not self.trusts(peer):
            return None
        value = value.strip()
        if not value or len(value) > _MAX_IDENTITY_CHARS or not value.isprintable():
            return None
        return value
