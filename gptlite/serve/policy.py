"""The server's rules for its clients (`Policy`: its key, host names, CORS origins, body size and time) and what a
loopback address is: what the command reads from its options before the server starts, with no web framework
imported (gptlite.serve.guard enforces them)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MB = 2**20


@dataclass(frozen=True)
class Policy:
    """The server's rules for its clients (see the module docstring); the defaults are a loopback server's."""

    api_key: str = ""  # "" = no key asked
    allowed_hosts: tuple[str, ...] | None = ()  # Host names accepted besides loopback ones; None = any name
    cors_origins: tuple[str, ...] = ()  # origins whose pages may call the API ("*": any); () = no CORS
    max_body_mb: float = 4.0
    read_timeout: float = 30.0  # seconds for a request's body to arrive (its headers: gptlite.serve.connection)

    @property
    def max_body(self) -> int:
        return int(self.max_body_mb * MB)


def is_loopback(host: str) -> bool:
    """Whether a host name or address (no port) can only mean this machine."""
    host = host.lower().rstrip(".").removeprefix("[").removesuffix("]")
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: never resolved to another machine
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
