"""This machine's side of the network: the address it reaches a host from."""
from __future__ import annotations

import socket

__all__ = ["route_address"]


def route_address(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host`` (no packet is
    sent: a UDP socket's connect only picks the route)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        return sock.getsockname()[0]
