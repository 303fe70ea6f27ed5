"""Where this node's ranks sit in the job: one machine, or several joined by
torch.distributed's elastic rendezvous (the engine torchrun uses).

A group object is made in the kernel and asked, once per attempt and only
after the node's ranks are forked, to ``join``: it returns a
:class:`Placement` (this node's rank, the world, the address of the ranks'
store). While the ranks run, the call watch ``publish``-es this node's first
failure and ``poll``-s for another node's, so a failure anywhere stops every
node within a poll period instead of a collective's 30-minute timeout.

Membership is torch's ``c10d`` (dynamic: nodes get their rank in arrival
order), or ``static`` (each node says its rank; node 0 hosts the endpoint's
store). nblaunch keeps per attempt, on the endpoint's store, who came and
who left (and who left early); on the round's store, where the ranks' store
is, the first failure, and an exit count (node 0 keeps the ranks' store up
until every node's ranks are done, as torchrun's exit barrier does).
"""
from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional, Protocol

from ..errors import LaunchError, RankFailure, from_record, to_record

__all__ = ["Placement", "SingleNode", "NodeGroup", "host_store"]

_POLL_S = 0.25
_SLICE_S = 0.05  # how often a join's waits look whether the launch was closed
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class Placement:
    node_rank: int
    num_nodes: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.local_world_size

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_world_size


def host_store(addr: str, world_size: int, timeout_s: float):
    """Host a TCPStore on ``addr`` at a port the OS picks; return ``(store, port)``.

    The listening socket is made here and handed over (the store owns it from
    then on) because torch's own server binds every interface, dual-stack.
    Binding ``addr`` alone keeps a single-node launch on loopback; it also
    keeps peers' addresses plain IPv4, which torch formats with a reverse
    lookup that, for ``::ffff:127.0.0.1``, goes to DNS and stalls seconds
    on a machine whose resolver is unreachable (measured: 5 s launches).
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((addr, 0))
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    store = dist.TCPStore(addr, port, world_size, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s),
                          master_listen_fd=sock.detach())
    return store, port


class Nodes(Protocol):
    """What a rank pool asks of the nodes its ranks belong to."""

    num_nodes: int

    def join(self, attempt: int) -> Placement:
        """Once this node's ranks are started: where they sit in the job."""

    def publish(self, failure: RankFailure) -> None:
        """Tell every other node about this node's first failure."""

    def poll(self, force: bool = False) -> Optional[RankFailure]:
        """Another node's failure, if one was published."""

    def finish(self, succeeded: bool) -> Optional[RankFailure]:
        """This node's ranks are done: the exit barrier (on success)."""

    def close(self) -> None:
        """Leave; safe to call twice."""


class SingleNode:
    """One machine: the kernel hosts the ranks' store, nothing to coordinate."""

    num_nodes = 1

    def __init__(self, addr: str, local_world_size: int, store_timeout_s: float):
        self.addr = addr
        self._n = local_world_size
        self._timeout = store_timeout_s
        self._store = None

    def join(self, attempt: int) -> Placement:
        self._store, port = host_store(self.addr, self._n, self._timeout)
        return Placement(0, 1, self._n, self.addr, port)

    def publish(self, failure: RankFailure) -> None:
        pass

    def poll(self, force: bool = False) -> Optional[RankFailure]:
        return None

    def finish(self, succeeded: bool) -> Optional[RankFailure]:
        self._store = None
        return None

    def close(self) -> None:
        self._store = None


class _Rendezvous:
    """The gathering at ``endpoint`` by torch.distributed.elastic's rendezvous: the endpoint's store
    (``_raw``) and, for c10d, torch's handler. A join runs in a helper thread (the cell's stays
    interruptible), and ``close``, the launch's end (an interrupt's too), ends it: its waits poll in
    slices of ``_SLICE_S``, a node connects once the endpoint listens, the static rendezvous is a
    count (torch's waits in its store's constructor), and torch's c10d join ends once marked closed."""

    def __init__(self, *, num_nodes: int, node_rank: Optional[int], endpoint: str, backend: str,
                 run_id: str, rdzv_timeout_s: float, local_world_size: int, addr: str,
                 store_timeout_s: float):
        self.num_nodes = num_nodes
        self.addr = addr
        self._node_rank = node_rank
        self._endpoint = endpoint
        self._backend = backend
        self._run_id = run_id
        self._rdzv_timeout = rdzv_timeout_s
        self._n = local_world_size
        self._store_timeout = store_timeout_s
        self._handler = self._rdzv = self._params = None  # c10d: torch's handler, its backend and parameters
        self._raw = None  # the endpoint's store itself (who came, who left)
        self._store = self._ranks_store = None  # this round's rendezvous store; node 0: the ranks' TCPStore
        self._prefix, self._attempt = "", 0
        self._rank: Optional[int] = None  # this node's rank in this attempt's round
        self._published = self._settled = False  # settled: this attempt's ranks are done here (finish)
        self._lost = False  # the rendezvous store went away (its host node ended)
        self._last_poll = 0.0
        self._lock = threading.Lock()
        self._closing = threading.Event()  # close() was called: a join in flight gives up
        self._idle = threading.Event()  # no join in flight
        self._idle.set()
        self._abandoned = False  # close() stopped waiting for a join: the join releases when it ends
        self._state = threading.Lock()  # join and close: who is in flight, who releases

    def _connect(self, deadline: float) -> None:
        """``_raw``: this node's client of the endpoint's store (or the store, hosted here); c10d: the handler."""
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        host, port = parse_rendezvous_endpoint(self._endpoint, -1)
        timeout = int(max(1, round(self._rdzv_timeout)))
        # Clients connect within CLOSE_WAIT_S (no wait for a host gone since it listened); ops time out as before.
        connect, ops = datetime.timedelta(seconds=CLOSE_WAIT_S), datetime.timedelta(seconds=max(60, timeout))
        if self._backend == "static":  # node 0 hosts the endpoint, as with torch's static rendezvous
            if self._node_rank != 0:
                self._wait_listening(host, port, deadline)
            self._raw = dist.TCPStore(host, port, None, self._node_rank == 0, connect, wait_for_workers=False,
                                      multi_tenant=True)
            self._raw.set_timeout(datetime.timedelta(seconds=timeout))
            return
        params = RendezvousParameters(
            backend=self._backend, endpoint=self._endpoint, run_id=self._run_id,
            min_nodes=self.num_nodes, max_nodes=self.num_nodes,
            # local_addr given: torch never falls back to socket.getfqdn() (a DNS lookup, stalls without resolver)
            local_addr=self.addr, join_timeout=timeout, last_call_timeout=1, close_timeout=int(CLOSE_WAIT_S),
            read_timeout=int(CLOSE_WAIT_S), **({"rank": self._node_rank} if self._node_rank is not None else {}))
        # The registry's c10d factory, in its two public steps: nblaunch keeps the backend's store.
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        # torch picks the host by name, which a plain interface address (no DNS entry) never matches:
        # hosted here when the endpoint is one of this machine's addresses, unless a launcher here does.
        for is_host in ([True, False] if _is_local(host) else [False]):
            params.config["is_host"] = is_host
            if not is_host:
                self._wait_listening(host, port, deadline)
            try:
                rdzv, raw = create_backend(params)
                break
            except Exception:
                if not is_host:
                    raise
        # The round's store (torch's join ends in a get on it) on a client of its own: close() uses the backend's.
        rounds = dist.TCPStore(host, port, None, False, connect)
        raw.set_timeout(ops)
        rounds.set_timeout(ops)
        self._handler = create_handler(rounds, rdzv, params)
        self._rdzv, self._params = rdzv, params
        self._raw = raw  # last: once it is set, close() finds all it needs to close the rendezvous

    def _wait_listening(self, host: str, port: int, deadline: float) -> None:
        """Until the endpoint's host listens (a plain socket, which says nothing to it)."""
        while True:
            wait = min(1.0, max(_SLICE_S, deadline - time.monotonic()))
            try:
                return socket.create_connection((host, port), wait).close()
            except OSError:
                self._pause(deadline)

    def _static_round(self, deadline: float):
        """The static rendezvous: whole once every node has counted itself in (``join``)."""
        from torch.distributed import PrefixStore

        while self._raw.add(self._key("arrived"), 0) < self.num_nodes:
            self._check_gathering()
            self._pause(deadline)
        return PrefixStore(self._run_id, self._raw), self._node_rank, self.num_nodes

    def _check_gathering(self) -> None:
        """Raise if another node left this attempt before every node's ranks were started."""
        key = self._key("closed")
        if self._raw.check([key]):
            raise LaunchError(f"{self._raw.get(key).decode()} left the rendezvous {self._run_id!r} before every "
                              "node's ranks started (interrupted, or a failure there): start it again on every node.")

    def _pause(self, deadline: float) -> None:
        """One slice of a wait: raises once ``close`` was called or ``deadline`` passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"waited {self._rdzv_timeout:g} s")
        self._closing.wait(min(_SLICE_S, left))
        self._check_open()

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise LaunchError("the launch ended while its nodes gathered")

    def _arrived(self) -> int:
        try:
            return self._raw.add(self._key("arrived"), 0)
        except Exception:  # not connected, or the store is gone
            return 0

    def _key(self, what: str) -> str:  # a key of this attempt on the endpoint's store
        return f"nblaunch/{self._run_id}/{what}/{self._attempt}"

    def _join_error(self, exc: Exception) -> LaunchError:
        first = (str(exc).strip().splitlines() or [""])[0]
        if type(exc).__name__ == "RendezvousClosedError":
            return LaunchError(f"the rendezvous {self._run_id!r} was closed before it completed (another node's "
                               "launch was interrupted, failed or ended): start it again on every node.")
        what, came = f"not every one of the {self.num_nodes} nodes joined", self._arrived()
        if came:
            what = f"{came} of {self.num_nodes} nodes joined"
        elif self._backend == "static" and self._node_rank != 0:
            what = f"node 0, which hosts {self._endpoint}, never answered"
        detail = f" ({type(exc).__name__}: {first})" if first else f" ({type(exc).__name__})"
        return LaunchError(
            f"the rendezvous {self._run_id!r} at {self._endpoint} ({self._backend}) did not complete "
            f"within {self._rdzv_timeout:g} s: {what}. Start the same launch on every node "
            f"(same rdzv_endpoint, rdzv_id and num_nodes), or raise rdzv_timeout.{detail}")

    def _end_c10d_join(self) -> None:
        """torch's c10d join polls its state, and ends once that says closed: marked so by a
        handler of our own (the join's is busy in its thread)."""
        if self._rdzv is not None:
            try:
                from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

                create_handler(self._raw, self._rdzv, self._params).set_closed()
            except Exception:
                pass


class NodeGroup(_Rendezvous):
    """Several machines (or several launcher processes) joined through
    torch.distributed.elastic's rendezvous at ``endpoint``."""

    # -- joining -------------------------------------------------------------

    def join(self, attempt: int) -> Placement:
        """Rendezvous with the other nodes; blocks up to ``rdzv_timeout``, or until ``close``."""
        with self._state:
            self._check_open()
            self._idle.clear()
        try:
            return self._join(attempt)
        finally:
            with self._state:
                self._idle.set()
                release = self._abandoned
            if release:
                self._release()

    def _join(self, attempt: int) -> Placement:
        self._published = self._lost = self._settled = False
        self._attempt, self._rank, self._prefix = attempt, None, f"nblaunch/{attempt}/"
        deadline = time.monotonic() + self._rdzv_timeout
        try:
            if self._raw is None:
                self._connect(deadline)
            self._raw.add(self._key("arrived"), 1)
            self._check_open()
            if self._handler is not None:
                info = self._handler.next_rendezvous()
                # torch < 2.4 returns (store, rank, world_size); later a RendezvousInfo.
                store, node_rank, num_nodes = (info if isinstance(info, tuple)
                                               else (info.store, info.rank, info.world_size))
            else:
                store, node_rank, num_nodes = self._static_round(deadline)
            self._store, self._rank = store, node_rank  # formed: leaving now, it says so (_release)
            self._check_open()
        except LaunchError:
            raise
        except Exception as exc:
            self._check_open()  # closed meanwhile: that, not the error it caused, is what happened
            raise self._join_error(exc) from exc
        if num_nodes != self.num_nodes:
            raise LaunchError(f"the rendezvous at {self._endpoint} formed {num_nodes} nodes, "
                              f"this node expected num_nodes={self.num_nodes}")
        key = self._prefix + "ranks_store"
        if node_rank == 0:
            self._ranks_store, port = host_store(self.addr, self.num_nodes * self._n, self._store_timeout)
            store.set(key, json.dumps({"addr": self.addr, "port": port, "nproc": self._n}))
        where = self._ranks_store_address(store, key, node_rank)
        if where["nproc"] != self._n:
            raise LaunchError(f"every node must start the same number of ranks: node 0 has "
                              f"num_processes={where['nproc']}, node {node_rank} has {self._n}")
        return Placement(node_rank, num_nodes, self._n, where["addr"], where["port"])

    def _ranks_store_address(self, store, key: str, node_rank: int) -> dict:
        """Where node 0 hosts the ranks' store, once it says so."""
        deadline = time.monotonic() + self._rdzv_timeout
        try:
            while not store.check([key]):
                self._check_gathering()
                self._pause(deadline)
            self._check_gathering()
            return json.loads(store.get(key))
        except LaunchError:
            raise
        except Exception as exc:
            self._check_open()
            raise LaunchError(f"node {node_rank}: node 0 never said where the ranks' store is ({exc})") from exc

    # -- while the ranks run -----------------------------------------------------

    def publish(self, failure: RankFailure) -> None:
        """Tell every node about this node's failure; the first one told wins."""
        if self._published or self._store is None or self._lost:
            return
        self._published = True
        try:
            with self._lock:
                self._store.compare_set(self._prefix + "failure", "", to_record(failure))
        except Exception:
            self._lost = True

    def poll(self, force: bool = False) -> Optional[RankFailure]:
        """Another node's failure, if one was published (at most every 0.25 s)."""
        now = time.monotonic()
        if self._store is None or self._lost or (not force and now - self._last_poll < _POLL_S):
            return None
        self._last_poll = now
        key = self._prefix + "failure"
        try:
            with self._lock:
                if not self._store.check([key]):
                    return None
                record = self._store.get(key)
        except Exception:
            self._lost = True
            return None
        return from_record(record)

    def finish(self, succeeded: bool) -> Optional[RankFailure]:
        """After this node's ranks ended. On success, wait until every node's
        ranks are done (node 0 hosts their store until then) or one failed,
        and return that failure. Always drops this attempt's ranks' store."""
        failure = None
        try:
            if succeeded and self._store is not None and not self._lost:
                failure = self._exit_barrier()
            self._settled = True
        finally:
            self._ranks_store = None
        return failure

    def _exit_barrier(self) -> Optional[RankFailure]:
        key = self._prefix + "done"
        deadline = time.monotonic() + max(self._store_timeout, self._rdzv_timeout)
        try:
            with self._lock:
                done = self._store.add(key, 1)
            while done < self.num_nodes and time.monotonic() < deadline:
                failure = self.poll(force=True)
                if failure is not None or self._lost:
                    return failure
                time.sleep(_POLL_S)
                with self._lock:
                    done = self._store.add(key, 0)
        except Exception:
            # The store's host node ended: it only does after every node was done.
            self._lost = True
        return None

    # -- leaving -------------------------------------------------------------------

    def close(self) -> None:
        """Leave (safe twice): the launch's end, an interrupt's too; a join in flight is ended first."""
        with self._state:
            self._closing.set()
            joining = not self._idle.is_set()
        if joining:
            try:
                # A round every node came to is let complete first (c10d: its nodes wait in it for this one).
                if self._arrived() >= self.num_nodes:
                    self._idle.wait(CLOSE_WAIT_S)
                if not self._idle.is_set():
                    self._end_c10d_join()
                self._idle.wait(CLOSE_WAIT_S)
            finally:  # still joining (where no slice reaches, or interrupted again): it releases at its end
                with self._state:
                    self._abandoned = not self._idle.is_set()
            if self._abandoned:
                return
        self._release()

    def _release(self) -> None:
        """Drop every store; a node leaving before its ranks are done says so, for the others to stop. The
        endpoint's host keeps its store until every node that came left (at most ``CLOSE_WAIT_S``): a
        store vanishing under a node makes torch print pages of C++ warnings into its cell."""
        with self._state:
            handler, store, raw = self._handler, self._store, self._raw
            self._handler = self._store = self._raw = self._ranks_store = self._rdzv = self._params = None
        if raw is None or self._lost:
            return
        try:
            if not self._settled:
                if store is not None and not self._published:
                    self._published = True
                    early = RankFailure(self._rank * self._n, "node", time.time(), node=self._rank,
                                        message="left before its ranks were done (interrupted, or a failure there)")
                    store.compare_set(self._prefix + "failure", "", to_record(early))
                who = self._node_rank if self._rank is None else self._rank
                raw.compare_set(self._key("closed"), "", f"the node at {self.addr}" if who is None else f"node {who}")
            if handler is not None:
                handler.shutdown()
            came = raw.add(self._key("arrived"), 0)
            left = raw.add(self._key("left"), 1)
            if _hosts_port(self._endpoint):
                deadline = time.monotonic() + CLOSE_WAIT_S
                while left < came and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = raw.add(self._key("left"), 0)
        except Exception:
            pass


def _is_local(host: str) -> bool:
    """Whether ``host`` names one of this machine's own addresses."""
    import psutil

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(w in mine or w.startswith("127.") or w == "::1" for w in wanted)


def _hosts_port(endpoint: str) -> bool:
    """Whether this process listens on the endpoint's port (hosts its store)."""
    import psutil

    port = int(endpoint.rpartition(":")[2])
    me = psutil.Process()
    conns = me.net_connections("tcp") if hasattr(me, "net_connections") else me.connections("tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)
