"""Lost nodes of a launch joined by torch's elastic rendezvous (``rdzv_endpoint``), and going on
without them (``min_nodes``).

While its ranks run, each node beats on the endpoint's store (a counter it adds to every second
or so) and watches the others' counters (:class:`Heartbeats`). A node silent for the launch's
``node_lost_after`` (default ``NBLAUNCH_NODE_LOST_AFTER``, else 10 s) is lost (its launcher died, its machine went
down): the node that sees it first publishes it as the generation's failure (kind ``node``,
``exc_type`` :data:`NODE_LOST`), and every node stops its ranks at once, as for any failure.

With ``min_nodes`` (and ``max_restarts``) the next generation runs on the nodes still up
(:meth:`WatchedNodes.shrink`): they meet in a fresh c10d round, run id ``<rdzv_id>.<attempt>``,
of ``min_nodes`` to the nodes still up (``torchrun --nnodes=2:3``'s), which gives node ranks,
``RANK`` and ``WORLD_SIZE`` again. It completes once every node still up came, or
``min_nodes`` did and the last call (``NBLAUNCH_NODE_LOST_AFTER``) passed.

A launcher started again with the same ``rdzv_endpoint`` and ``rdzv_id`` is taken back, up to
``max_nodes`` (:mod:`.rejoin`): it knocks at the next round, the nodes running see it in their
heartbeat's look, and once it has waited ``node_back_after`` the run resizes into it.

The endpoint's store lives in the launcher that hosts ``rdzv_endpoint``. If that node is lost,
the store goes with it: nothing is left for the others to meet on, so the run cannot go on;
every node's error says so (``exc_type`` :data:`STORE_LOST`), and a restart is not tried.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import threading
import time
from typing import Optional

from ..config import lost_after
from ..errors import LaunchError, RankFailure
from .nodes import CLOSE_WAIT_S, NodeGroup, Placement
from .rejoin import Gate

__all__ = ["WatchedNodes", "Heartbeats", "NODE_LOST", "STORE_LOST"]

NODE_LOST = "NodeLost"  # a lost node's failure (its exc_type): the survivors may go on without it
STORE_LOST = "StoreLost"  # the node hosting rdzv_endpoint's store was lost: no one can go on
_POLL_S = 0.1  # causes' look at the store
_DONE = 1 << 40  # added to a node's counter once its part of the attempt is over


class Heartbeats:
    """This node's heartbeat and its watch on the other nodes, in one thread, on ``store`` (a
    client of the endpoint's store of its own). ``lost``: node -> seconds its counter had stood
    still when it was found lost; ``store_error``: the store went away (set while running only)."""

    def __init__(self, store, prefix: str, me: int, num_nodes: int, info: dict, lost_after_s: float,
                 gate: Optional[tuple] = None):
        self._store, self._prefix, self._me, self._info = store, prefix, me, info
        # (Gate on this thread's store client, this attempt): who knocks at the next round, a
        # resize published; ``resize_wish``, set by the kernel's thread, is published here
        self._gate = gate
        self.knocking: list = []
        self.resized: list = []
        self.resize_wish: list = []
        self._others = [k for k in range(num_nodes) if k != me]
        self.lost_after = lost_after_s
        self.interval = min(1.0, lost_after_s / 4)
        now = time.monotonic()
        self.moved = {k: now for k in self._others}  # the look that saw each node's counter move last (or the start)
        self.beat_after = dict(self.moved)  # the look before it: that beat came after this
        self._counts: dict = {}
        self._looked = now
        self.infos: dict[int, dict] = {}  # what each node said of itself: {"addr": ..., "store": hosts it}
        self.lost: dict[int, float] = {}
        self.store_error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nblaunch-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (a store operation in flight ends within its timeout)."""
        self._stop.set()
        self._thread.join(self.lost_after + 5)

    def heard_from_all_since(self, t: float) -> bool:
        """Whether every other node has beaten after ``t`` (``time.monotonic``): a look after
        ``t`` saw its counter move since the look before, itself after ``t``."""
        return all(self.beat_after[k] >= t for k in self._others)

    def last_heard(self, k: int) -> float:
        """A wall-clock time before node ``k``'s last beat, so before its loss."""
        return time.time() - (time.monotonic() - self.beat_after[k])

    def _key(self, what) -> str:
        return f"{self._prefix}/{what}"

    def _run(self) -> None:
        try:
            self._store.set(self._key(f"info/{self._me}"), json.dumps(self._info))
            while not self._stop.is_set():
                self._store.add(self._key(self._me), 1)
                self._look()
                self._stop.wait(self.interval)
            self._store.add(self._key(self._me), _DONE)  # this node's part is over: no one waits for its beat
        except Exception as exc:  # noqa: BLE001 - the store went away (its host ended), or stalled
            if not self._stop.is_set():
                self.store_error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]

    def _look(self) -> None:
        keys = [self._key(k) for k in self._others]
        if self._counts:
            counts = [int(v) for v in self._store.multi_get(keys)]
        else:  # the first look also makes the keys of nodes that have not beaten yet
            counts = [self._store.add(key, 0) for key in keys]
        now, before, self._looked = time.monotonic(), self._looked, time.monotonic()
        for k, count in zip(self._others, counts):
            if count >= _DONE:
                self.moved[k] = self.beat_after[k] = math.inf
            elif self._counts.get(k) != count:
                if k in self._counts:
                    self.moved[k], self.beat_after[k] = now, before
                self._counts[k] = count
            elif now - self.moved[k] > self.lost_after and k not in self.lost:
                self.lost[k] = now - self.moved[k]
        for k in [k for k in self._others if k not in self.infos]:
            if self._store.check([self._key(f"info/{k}")]):
                self.infos[k] = json.loads(self._store.get(self._key(f"info/{k}")))
        if self._gate is not None:
            gate, attempt = self._gate
            self.knocking = gate.knocking(attempt + 1)
            self.resized = gate.resize(attempt, self.resize_wish or None)


class _Round:
    """A fresh round's handler as :class:`NodeGroup` joins with it: the group is as many
    nodes as the round formed (``min_nodes`` to the nodes still up)."""

    def __init__(self, handler, group: "WatchedNodes"):
        self._handler, self._group = handler, group

    def next_rendezvous(self):
        info = self._handler.next_rendezvous()
        self._group.num_nodes = info[2] if isinstance(info, tuple) else info.world_size
        return info

    def shutdown(self) -> bool:
        return self._handler.shutdown()


class WatchedNodes(NodeGroup):
    """A :class:`NodeGroup` whose nodes watch each other's heartbeats while their ranks run, and
    that goes on without lost nodes when ``min_nodes`` allows (c10d only)."""

    def __init__(self, *, min_nodes: Optional[int] = None, lost_after_s: Optional[float] = None,
                 max_nodes: Optional[int] = None, back_after_s: float = 10.0, **group):
        super().__init__(**group)
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes or self.num_nodes  # the most nodes a round grows back to
        self.back_after = back_after_s
        self._gate: Optional[Gate] = None  # c10d with min_nodes: launchers started again knock here
        self._me = ""  # this launcher, as a knock names it
        self._offset = 0  # a launcher that came late: the run's attempt when this one's first began
        self._knocked_at: Optional[float] = None  # since when someone has knocked at the next round
        self.lost_after = lost_after_s if lost_after_s is not None else lost_after()  # the launch's node_lost_after
        self._beats: Optional[Heartbeats] = None
        self._beat_store = self._spare = None  # clients of the endpoint's store: the heartbeats', fresh rounds'
        self._hosting = False  # this launcher hosts the endpoint's store
        self._fresh = False  # after a lost node: every attempt is a fresh round
        self._told = False  # this attempt's lost node was published
        self._store_lost: Optional[RankFailure] = None
        self._dropped = False  # the others found this node lost: their next round is not its

    # -- joining -----------------------------------------------------------------

    def _connect(self, deadline: float) -> None:
        """The group's connections, and two more made with them, before this node joins the round
        (so before any node is past it): a connection the endpoint's host accepted later could
        come while it forks its next ranks, whose resolver lock its accept may hold."""
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        super()._connect(deadline)
        host, port = parse_rendezvous_endpoint(self._endpoint, -1)
        connect = datetime.timedelta(seconds=CLOSE_WAIT_S)
        self._beat_store = dist.TCPStore(host, port, None, False, connect)
        self._beat_store.set_timeout(datetime.timedelta(seconds=self.lost_after + 2))
        if self._params is not None:  # c10d
            self._hosting = bool(self._params.config.get("is_host"))
            self._spare = dist.TCPStore(host, port, None, False, connect)
            self._spare.set_timeout(datetime.timedelta(seconds=max(60, int(self._rdzv_timeout))))
            if self.min_nodes is not None:
                self._gate = Gate(self._raw, self._run_id)
                self._me = f"{self.addr} (pid {os.getpid()})"
        else:
            self._hosting = self._node_rank == 0

    def _join(self, attempt: int) -> Placement:
        self._stop_beats()
        self._told, self._store_lost, self._knocked_at = False, None, None
        if self._raw is None and self.min_nodes is not None and self._backend == "c10d":
            try:
                self._connect(time.monotonic() + self._rdzv_timeout)
                self._catch_up(attempt)
            except LaunchError:
                raise
            except Exception as exc:
                self._check_open()
                raise self._join_error(exc) from exc
        attempt += self._offset  # the run's attempt: rounds, heartbeats and failures are named by it
        size = None
        if self._fresh:
            if self._offset == 0 or attempt > self._offset:  # a late launcher's first round was sealed by the others
                self._gate.set_current(attempt)
                size = min(self.max_nodes, self.num_nodes + len(self._gate.seal(attempt)))
            self._new_round(attempt, size)
        pl = super()._join(attempt)
        if self._beat_store is not None and not self._closing.is_set():
            gate = (Gate(self._beat_store, self._run_id), attempt) if self._gate is not None else None
            self._beats = Heartbeats(self._beat_store, f"nblaunch/{self._run_id}/beat/{attempt}", pl.node_rank,
                                     pl.num_nodes, {"addr": self.addr, "store": self._hosting}, self.lost_after, gate)
        return pl

    def _catch_up(self, attempt: int) -> None:
        """A launcher started after the run went on without a lost node: it knocks at the round
        after the one running, and waits in it (the nodes running grow into it)."""
        current = self._gate.current()
        if current is None:
            return  # the run never shrank: this is one of its first launchers
        while not self._gate.knock(current + 1, self._me):
            current = self._gate.current()  # that round formed meanwhile: the next one
        self._offset, self._fresh = current + 1 - attempt, True

    def _new_round(self, attempt: int, size: Optional[int] = None) -> None:
        """A c10d round of its own (run id ``<rdzv_id>.<attempt>``) of ``min_nodes`` to ``size``
        (those still up and those who knocked; a late launcher: ``max_nodes``)."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        rdzv, params = self._round(attempt, size or self.max_nodes)
        handler = _Round(create_handler(self._spare, rdzv, params), self)
        with self._state:
            self._handler, self._rdzv, self._params = handler, rdzv, params

    def _round(self, attempt: int, size: Optional[int] = None) -> tuple:
        """The backend and parameters of the fresh round of ``attempt``."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

        run_id = f"{self._run_id}.{attempt}"
        params = RendezvousParameters(
            backend="c10d", endpoint=self._endpoint, run_id=run_id, min_nodes=min(self.min_nodes, self.num_nodes),
            max_nodes=size or self.num_nodes, local_addr=self.addr, join_timeout=int(max(1, round(self._rdzv_timeout))),
            last_call_timeout=int(max(1, round(self.lost_after))), close_timeout=int(CLOSE_WAIT_S),
            read_timeout=int(CLOSE_WAIT_S))
        return C10dRendezvousBackend(self._raw, run_id), params

    def _close_rounds(self) -> None:
        """This node leaves: the fresh rounds of this attempt and the next are closed, so a node
        that waits in one for it (it had gone on without a lost node; this one had not, or was
        interrupted before it came) ends at once instead of after ``rdzv_timeout``."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        for attempt in (self._attempt,) if self._dropped else (self._attempt, self._attempt + 1):
            try:
                create_handler(self._raw, *self._round(attempt)).set_closed()
            except Exception:  # noqa: BLE001 - the store is going: no one waits on it either
                return

    # -- while the ranks run -----------------------------------------------------------

    def poll(self, force: bool = False) -> Optional[RankFailure]:
        """Another node's failure; a lost node's, published here first if this node saw it first."""
        lost = self._lost_node()
        if lost is not None and lost.exc_type == STORE_LOST:
            return lost  # nothing to publish it on
        if lost is not None and not self._told:
            self._told = True
            self.publish(lost)  # the first failure published wins: every node sees the same
            force = True
        return super().poll(force)

    def causes(self, seen: Optional[RankFailure], grace: float) -> tuple:
        """After this node's ranks failed: ``(remote, lost)``, another node's failure (``seen``,
        or one published within ``grace``; None: publish ours) and a node lost meanwhile (None:
        none). While a node has not beaten since, this waits until it does or is found lost
        (``NBLAUNCH_NODE_LOST_AFTER``): when this node saw no cause elsewhere (a peer's connection
        closed: the loss, not its echo, is the cause), and with ``min_nodes`` always, so that
        every node still up blames the loss, dated before it, and they agree to go on."""
        t0 = time.monotonic()
        beats, remote, lost = self._beats, seen, None
        last = t0 + grace + (beats.lost_after + 2 * beats.interval if beats is not None else 0)
        watch = seen is None or self.min_nodes is not None
        while True:
            remote = remote or self.poll(force=True)
            lost = self._lost_node()
            now = time.monotonic()
            heard = beats is None or not watch or beats.heard_from_all_since(t0)
            if lost is not None or now >= last or ((remote is not None or now >= t0 + grace) and heard):
                break
            time.sleep(_POLL_S)
        if lost is not None and remote is not None and (remote.exc_type, remote.node) == (lost.exc_type, lost.node):
            lost = None  # the same loss, published
        return remote, lost

    def _lost_node(self) -> Optional[RankFailure]:
        beats = self._beats
        if beats is None:
            return None
        if beats.store_error is not None:
            self._lost = True  # no store operation is tried again (each would wait out its timeout)
            if self._store_lost is None:
                self._store_lost = self._store_lost_failure(beats)
            return self._store_lost
        if not beats.lost:
            return None
        k = min(beats.lost)
        at = f" at {beats.infos[k]['addr']}" if k in beats.infos else ""
        return RankFailure(k * self._n, "node", beats.last_heard(k), exc_type=NODE_LOST, node=k,
                           message=f"was lost: its launcher{at} sent no heartbeat for {beats.lost[k]:.0f} s")

    def _store_lost_failure(self, beats: Heartbeats) -> RankFailure:
        host = next((k for k, info in beats.infos.items() if info.get("store")), None)
        what = "was lost, and with it the rendezvous store it hosted" if host is not None else (
            "the rendezvous store was lost")
        return RankFailure((host or 0) * self._n, "node", time.time(), exc_type=STORE_LOST, node=host, message=(
            f"{what} (rdzv_endpoint {self._endpoint}: {beats.store_error}): the nodes still up have nothing "
            "to meet on, so the run cannot go on, with or without min_nodes (start it again on the nodes "
            "still up, with rdzv_endpoint on one of them)"))

    def nodes_back(self) -> list:
        """Launchers that knocked at the next round and have waited ``node_back_after`` (as many as
        ``max_nodes`` leaves room for), once one node published the resize: every node names the same."""
        beats = self._beats
        if beats is None or self._gate is None:
            return []
        if beats.resized:
            return list(beats.resized)
        room = self.max_nodes - self.num_nodes
        if not beats.knocking or room <= 0:
            self._knocked_at = None
            return []
        now = time.monotonic()
        self._knocked_at = self._knocked_at or now
        if now - self._knocked_at >= self.back_after:
            beats.resize_wish = beats.knocking[:room]  # published at the heartbeat's next look
        return []

    def resized_elsewhere(self) -> list:
        """After this node's ranks all returned: the resize another node published for this
        attempt (its ranks' notice ended theirs, ``preempted(agree=True)``, before this node's
        look saw it), read now that the heartbeat thread is over; [] if none."""
        if self._gate is None or self._beats is None:
            return []
        return self._beats.resized or Gate(self._beat_store, self._run_id).resize(self._attempt)

    def grow(self, names: list) -> list:
        """The next round is larger by ``names`` (it forms with whoever knocked)."""
        self.num_nodes, self._fresh = min(self.max_nodes, self.num_nodes + len(names)), True
        return list(names)

    # -- after -------------------------------------------------------------------------

    def shrink(self, failures: list) -> bool:
        """After a generation that lost nodes: the next runs on the nodes still up if ``min_nodes``
        allows (True), as a fresh round. Not where the store was lost, nor with ``static``."""
        lost = {f.node for f in failures if f.kind == "node" and f.exc_type == NODE_LOST}
        if lost and self._beats is not None:  # only with a loss every node was told of: they agree to go on
            lost |= set(self._beats.lost)
        # A node the others found lost (it was too slow to beat) is not in their next round.
        self._dropped = self._rank in lost
        if (not lost or self._dropped or self.min_nodes is None or self._backend != "c10d" or self._raw is None
                or any(f.exc_type == STORE_LOST for f in failures)
                or self.num_nodes - len(lost) < self.min_nodes):
            return False
        old, self.num_nodes, self._fresh = self._handler, self.num_nodes - len(lost), True
        try:  # the lost generation's round is over for good: its keep-alive thread ends too
            old.shutdown()
        except Exception:  # noqa: BLE001 - a round closed already
            pass
        return True

    def finish(self, succeeded: bool) -> Optional[RankFailure]:
        try:
            return super().finish(succeeded)
        finally:
            self._stop_beats()  # before the next generation's forks

    def _release(self) -> None:
        self._stop_beats()
        if self.min_nodes is not None and self._params is not None and self._raw is not None and not self._lost:
            self._close_rounds()
        super()._release()
        self._beat_store = self._spare = None

    def _stop_beats(self) -> None:
        if self._beats is not None:  # kept: what it found lost is still read (shrink)
            self._beats.stop()
