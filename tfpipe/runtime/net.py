"""Network addresses: ``HOST:PORT`` as the user writes it, and a free port for a server started on this machine."""

from __future__ import annotations

import re
import socket

MAX_PORT = 65535


def host_and_port(address: object) -> tuple[str, int] | None:
    """``HOST:PORT`` as (host, port), the port any number (the caller says which it dials); None when ``address``
    is not of that form (no host, no port, a port that is not 1-5 ASCII digits, not a string)."""
    if not isinstance(address, str):
        return None
    host, _, port = address.rpartition(":")
    return (host, int(port)) if host and re.fullmatch("[0-9]{1,5}", port) else None  # "²".isdigit()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server or process group this job starts on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
