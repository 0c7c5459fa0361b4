"""What the tools (and the test harness) need to start local ranks: a free TCP port for the rendezvous."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it), for ``MASTER_PORT``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
