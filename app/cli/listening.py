"""Refuse a server whose API address is taken before it touches its journal or Redis.

Uvicorn binds its socket only after the server has migrated its journal, paired with Redis and
started its lifespan; a port already in use then failed the start late, leaving that work
done. :func:`refuse_taken_port` tries the bind first, as uvicorn will (``SO_REUSEADDR``, IPv6
for a host with a colon), and lets the socket go again: uvicorn binds it for real moments later.
"""

from __future__ import annotations

import errno
import socket

from app.core.errors import ConfigError


def refuse_taken_port(
    host: str,
    port: int,
    what: str = "the API address",
    settings: str = "HOMEFLEET_API_PORT (or HOMEFLEET_API_HOST)",
) -> None:
    """Return when ``host``:``port`` (TCP) can be bound now.

    ``what`` names the address in the message (the API's, Flower's), ``settings`` what moves it.

    Raises:
        ConfigError: reason ``port_in_use`` when another socket listens there (naming the
            address and ``settings``); any other bind error (an address not on this host) is
            left for the server (uvicorn, Flower's tornado) to report.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                return
            shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
            raise ConfigError(
                f"{what} {shown} is in use by another process: stop it, or give this server another {settings}",
                reason="port_in_use",
            ) from error
