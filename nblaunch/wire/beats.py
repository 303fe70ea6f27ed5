"""Heartbeats both ways between the kernel (or a detached run's supervisor) and its nodes' agents,
on links that carry nothing else (:class:`~nblaunch.wire.agent_messages.BeatLink`).

The rule, as etcd's leases and torch elastic's keep-alives have it: a peer is silent once no
message from it arrived for ``lost_after`` seconds of elapsed time (``time.monotonic``), counted
from the last one received on its heartbeat link or, through :meth:`Beats.heard`, on its other
link (any message counts as a beat). Whoever looks decides; a closed connection is not needed.

The beats are sent and read in a thread of their own, on a link of their own: a busy relay, a
long drain, a debugger prompt or a large message crossing the other link never holds them. A
thread that was itself held (the machine too busy to run it) reads what arrived before it looks
at the clocks, so only a silent peer is called silent.
"""
from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Hashable, Optional

from .agent_messages import Heartbeat

__all__ = ["Beats", "interval_for"]


def interval_for(lost_after: float) -> float:
    """Seconds between beats: four or more fit in the lost-after time, one a second at most."""
    return min(1.0, lost_after / 4)


class Beats:
    """Beats on every link added, and the watch on their peers.

    ``on_silent(key, seconds)`` is called (in the thread) once a peer stood silent that long; what
    it returns, if not None, is sent to the peer before its link is closed (the kernel's
    ``Dropped``). ``on_word(key, message)``: anything but a heartbeat received, or None when the
    peer closed its link. ``silent`` maps each peer found silent to its seconds of silence."""

    def __init__(self, lost_after: float, on_silent: Callable[[Hashable, float], Any] = lambda key, s: None,
                 on_word: Callable[[Hashable, Any], None] = lambda key, message: None):
        self.lost_after = lost_after
        self.interval = interval_for(lost_after)
        self._on_silent, self._on_word = on_silent, on_word
        self._links: dict[Hashable, Connection] = {}
        self._heard: dict[Hashable, float] = {}
        self.silent: dict[Hashable, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake, self._wake_w = os.pipe()  # stop() ends the thread's wait at once, not at the next beat
        self._thread = threading.Thread(target=self._run, name="nblaunch-beats", daemon=True)
        # pydevd (JupyterLab's and VS Code's debugger) leaves its own threads running when it
        # suspends the others at a breakpoint: a kernel paused there still answers.
        self._thread.is_pydev_daemon_thread = True
        self._thread.pydev_do_not_trace = True
        self._thread.start()

    def add(self, key: Hashable, link: Connection) -> None:
        """Beat on ``link`` and watch its peer from now on."""
        with self._lock:
            self._links[key] = link
            self._heard[key] = time.monotonic()

    def heard(self, key: Hashable) -> None:
        """A message from ``key`` came on its other link: a beat."""
        if key in self._heard:
            self._heard[key] = time.monotonic()

    def quiet_for(self, key: Hashable) -> float:
        """Seconds since the last message from ``key``."""
        return time.monotonic() - self._heard.get(key, time.monotonic())

    def stop(self) -> None:
        """End the thread and close every link."""
        self._stop.set()
        with self._lock:  # the thread closes the pipe as it ends: never write to a number reused since
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")
        if self._thread is not threading.current_thread():
            self._thread.join(self.interval + 5)
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()

    def _close_wake(self) -> None:
        with self._lock:
            fds, self._wake, self._wake_w = (self._wake, self._wake_w), -1, -1
        for fd in fds:
            os.close(fd)

    def _run(self) -> None:
        try:
            self._beat()
        finally:
            self._close_wake()

    def _beat(self) -> None:
        due = 0.0
        while not self._stop.is_set():
            with self._lock:
                links = dict(self._links)
            if time.monotonic() >= due:
                for key, link in links.items():
                    self._send(key, link, Heartbeat())
                due = time.monotonic() + self.interval
            by_link = {link: key for key, link in links.items()}
            ready = wait([*by_link, self._wake], timeout=max(0.0, due - time.monotonic()))
            for link in ready:
                if link in by_link:
                    self._read(by_link[link], link)
            self._look()

    def _read(self, key: Hashable, link: Connection) -> None:
        try:
            while link.poll(0):
                message = link.recv()
                self._heard[key] = time.monotonic()
                if not isinstance(message, Heartbeat):
                    self._on_word(key, message)
        except (EOFError, OSError):
            link.close()
            self._forget(key)
            self._on_word(key, None)

    def _look(self) -> None:
        now = time.monotonic()
        with self._lock:
            quiet = [(key, now - self._heard[key]) for key in self._links if now - self._heard[key] > self.lost_after]
        for key, seconds in quiet:
            self.silent[key] = seconds
            last = self._on_silent(key, seconds)
            link = self._forget(key)
            if link is not None and last is not None:
                self._send(key, link, last)
            if link is not None:
                link.close()

    def _send(self, key: Hashable, link: Connection, message: Any) -> None:
        try:
            link.send(message)
        except (OSError, ValueError):
            pass  # the peer closed it: the next read says so

    def _forget(self, key: Hashable) -> Optional[Connection]:
        with self._lock:
            return self._links.pop(key, None)
