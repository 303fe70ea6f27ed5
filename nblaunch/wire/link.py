"""The authenticated channel between the kernel and the node agents of a
cluster launch (:mod:`nblaunch.engines.agent_engine`).

The kernel listens on one TCP port for the length of a cluster launch (or of
live ranks), on the address it uses to reach the nodes. Every connection must
prove, before any byte of it is unpickled, that it holds this launch's
secret, and the kernel proves it back: the HMAC challenge of
``multiprocessing.connection`` in both directions (the same handshake
``Listener``/``Client`` with an ``authkey`` do). The secret is fresh per
launch and travels to the agents in their environment, never on a command
line. A connection that fails the handshake is closed and logged; the launch
goes on.

Written on ``multiprocessing.connection``'s handshake rather than its
``Listener`` because ``Listener.accept`` authenticates inside the accept: one
peer that connects and stays silent would block every agent behind it. Here
each connection is authenticated in a thread of its own, with a deadline.

What this does not give: encryption. Messages (jobs, results, output) cross
the network in clear, as torch.distributed's own traffic does.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Optional

__all__ = ["Listener", "connect", "new_secret", "SECRET_ENV", "ADDRESS_ENV"]

log = logging.getLogger("nblaunch")

SECRET_ENV = "NBLAUNCH_AGENT_SECRET"  # hex; the agent removes it from its environment at once
ADDRESS_ENV = "NBLAUNCH_AGENT_ADDRESS"  # host:port of the kernel's listener
HANDSHAKE_S = 10.0  # a peer that has not proved the secret by then is dropped


def new_secret() -> bytes:
    return secrets.token_bytes(32)


class Listener:
    """Accepts agents on ``(host, 0)``; :meth:`get` hands over each
    authenticated connection with the first message it sent (its hello).
    ``refused`` lists the peers that failed the handshake."""

    def __init__(self, host: str, secret: bytes):
        self._secret = secret
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            raise
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self.refused: list[str] = []
        self._ready: "queue.Queue[tuple[Connection, object]]" = queue.Queue()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="nblaunch-listener", daemon=True).start()

    def get(self, timeout: float) -> Optional[tuple[Connection, object]]:
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop listening (connections already handed over stay open)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        while True:  # authenticated but never taken: close them
            try:
                conn, _ = self._ready.get_nowait()
            except queue.Empty:
                break
            conn.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock, peer), name="nblaunch-handshake",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket, peer) -> None:
        # A deadline on a silent peer: shutting the socket down wakes the
        # blocked read of the handshake (the Connection reads a dup of it).
        timer = threading.Timer(HANDSHAKE_S, _shutdown, args=(sock,))
        timer.daemon = True
        timer.start()
        _no_delay(sock)
        conn = Connection(os.dup(sock.fileno()))
        try:
            deliver_challenge(conn, self._secret)
            answer_challenge(conn, self._secret)
            hello = conn.recv()
        except (AuthenticationError, EOFError, OSError, ValueError) as exc:
            conn.close()
            who = f"{peer[0]}:{peer[1]}"
            self.refused.append(who)
            log.warning("nblaunch: refused a connection from %s to the agents' port: %s", who,
                        exc or type(exc).__name__)
            return
        finally:
            timer.cancel()
            sock.close()
        if self._closed.is_set():
            conn.close()
        else:
            self._ready.put((conn, hello))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _no_delay(sock: socket.socket) -> None:
    """Messages are small and come in bursts (a call to each of a node's
    ranks): with Nagle's algorithm each burst's second message waits for the
    peer's delayed ACK, 40 ms a call (measured: 44 ms live calls across nodes)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(address: tuple[str, int], secret: bytes) -> Connection:
    """An agent's connection to the kernel: the handshake of
    ``multiprocessing.connection.Client`` (answer, then challenge), on a
    socket without Nagle's delay."""
    sock = socket.create_connection(tuple(address))
    try:
        _no_delay(sock)
        conn = Connection(sock.detach())
    except BaseException:
        sock.close()
        raise
    try:
        answer_challenge(conn, secret)
        deliver_challenge(conn, secret)
    except BaseException:
        conn.close()
        raise
    return conn
