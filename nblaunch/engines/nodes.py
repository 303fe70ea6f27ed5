"""Where this node's ranks sit in the job: one machine, or several joined by
torch.distributed's elastic rendezvous (the engine torchrun uses).

A group object is made in the kernel and asked, once per attempt and only
after the node's ranks are forked, to ``join``: it returns a
:class:`Placement` (this node's rank, the world, the address of the ranks'
store). While the ranks run, the call watch ``publish``-es this node's first
failure and ``poll``-s for another node's, so a failure anywhere stops every
node within a poll period instead of a collective's 30-minute timeout.

Membership is torch's: ``c10d`` (dynamic: nodes get their rank in arrival
order) or ``static`` (each node says its rank). What nblaunch adds on top of
the rendezvous store is three keys per attempt: where the ranks' store is,
the first failure, and an exit count (so node 0 keeps the ranks' store up
until every node's ranks are done, as torchrun's exit barrier does).
"""
from __future__ import annotations

import datetime
import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional, Protocol

from ..errors import LaunchError, RankFailure, from_record, to_record

__all__ = ["Placement", "SingleNode", "NodeGroup", "host_store", "route_address"]

_POLL_S = 0.25
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


def route_address(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host`` (no packet is
    sent: a UDP socket's connect only picks the route)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        return sock.getsockname()[0]


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


class NodeGroup:
    """Several machines (or several launcher processes) joined through
    torch.distributed.elastic's rendezvous at ``endpoint``."""

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
        self._handler = None
        self._raw = None  # the c10d backend's own store (arrival counts)
        self._store = None  # this round's rendezvous store
        self._prefix = ""
        self._ranks_store = None  # node 0: the ranks' TCPStore
        self._published = False
        self._lost = False  # the rendezvous store went away (its host node ended)
        self._last_poll = 0.0
        self._lock = threading.Lock()

    # -- joining -------------------------------------------------------------

    def join(self, attempt: int) -> Placement:
        """Rendezvous with the other nodes; blocks up to ``rdzv_timeout``."""
        self._published = self._lost = False
        self._prefix = f"nblaunch/{attempt}/"
        if self._handler is None:
            self._handler = self._make_handler()
        if self._raw is not None:
            self._raw.add(self._arrivals_key(attempt), 1)
        try:
            info = self._handler.next_rendezvous()
        except Exception as exc:
            raise self._join_error(attempt, exc) from exc
        # torch < 2.4 returns (store, rank, world_size); later a RendezvousInfo.
        store, node_rank, num_nodes = info if isinstance(info, tuple) else (info.store, info.rank, info.world_size)
        if num_nodes != self.num_nodes:
            raise LaunchError(f"the rendezvous at {self._endpoint} formed {num_nodes} nodes, "
                              f"this node expected num_nodes={self.num_nodes}")
        self._store = store
        key = self._prefix + "ranks_store"
        if node_rank == 0:
            self._ranks_store, port = host_store(self.addr, self.num_nodes * self._n, self._store_timeout)
            store.set(key, json.dumps({"addr": self.addr, "port": port, "nproc": self._n}))
        try:
            store.wait([key], datetime.timedelta(seconds=self._rdzv_timeout))
            where = json.loads(store.get(key))
        except Exception as exc:
            raise LaunchError(f"node {node_rank}: node 0 never said where the ranks' store is "
                              f"({exc})") from exc
        if where["nproc"] != self._n:
            raise LaunchError(f"every node must start the same number of ranks: node 0 has "
                              f"num_processes={where['nproc']}, node {node_rank} has {self._n}")
        return Placement(node_rank, num_nodes, self._n, where["addr"], where["port"])

    def _make_handler(self):
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        timeout = int(max(1, round(self._rdzv_timeout)))
        params = RendezvousParameters(
            backend=self._backend, endpoint=self._endpoint, run_id=self._run_id,
            min_nodes=self.num_nodes, max_nodes=self.num_nodes,
            # Given, so torch never falls back to socket.getfqdn() (a DNS
            # lookup that stalls on a machine without a resolver).
            local_addr=self.addr,
            join_timeout=timeout, last_call_timeout=1, timeout=timeout,
            read_timeout=max(60, timeout), **({"rank": self._node_rank} if self._node_rank is not None else {}))
        if self._backend == "static":
            from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

            return create_rdzv_handler(params)
        # The registry's c10d factory, in its two public steps, so that
        # nblaunch keeps the backend store to count arrivals on.
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        # torch decides who hosts the endpoint's store by matching the host
        # name; a node addressed by a plain interface address (no DNS entry)
        # would never host it and every node would wait as a client. So:
        # host it when the endpoint is one of this machine's addresses, and
        # fall back to a client when another launcher here already does.
        host = self._endpoint.rpartition(":")[0].strip("[]")
        for is_host in ([True, False] if _is_local(host) else [False]):
            params.config["is_host"] = is_host
            try:
                backend, self._raw = create_backend(params)
                break
            except Exception:
                if not is_host:
                    raise
        return create_handler(self._raw, backend, params)

    def _arrivals_key(self, attempt: int) -> str:
        return f"nblaunch/{self._run_id}/arrived/{attempt}"

    def _join_error(self, attempt: int, exc: Exception) -> LaunchError:
        first = (str(exc).strip().splitlines() or [""])[0]
        what = f"not every one of the {self.num_nodes} nodes joined"
        counted = re.search(r"(\d+)/(\d+) clients joined", first)  # the static store's own count
        if self._raw is not None:
            try:
                what = f"{self._raw.add(self._arrivals_key(attempt), 0)} of {self.num_nodes} nodes joined"
            except Exception:
                pass
        elif counted:
            what = f"{counted[1]} of {counted[2]} nodes joined"
        elif self._backend == "static" and self._node_rank != 0:
            what = f"node 0, which hosts {self._endpoint}, never answered"
        detail = f" ({type(exc).__name__}: {first})" if first else f" ({type(exc).__name__})"
        return LaunchError(
            f"the rendezvous {self._run_id!r} at {self._endpoint} ({self._backend}) did not complete "
            f"within {self._rdzv_timeout:g} s: {what}. Start the same launch on every node "
            f"(same rdzv_endpoint, rdzv_id and num_nodes), or raise rdzv_timeout.{detail}")

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

    def close(self) -> None:
        """Leave the rendezvous. The node whose kernel hosts the endpoint's
        store keeps it up until every node has left (at most
        ``CLOSE_WAIT_S``): a store that vanishes under a node still using it
        makes torch print a page of C++ warnings into that node's cell."""
        handler, self._handler = self._handler, None
        store, raw = self._store, self._raw
        self._store = self._raw = self._ranks_store = None
        if handler is None or store is None or self._lost:
            return
        try:
            handler.shutdown()
            left = store.add("nblaunch/left", 1)
            if _hosts_port(self._endpoint):
                deadline = time.monotonic() + CLOSE_WAIT_S
                while left < self.num_nodes and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = store.add("nblaunch/left", 0)
        except Exception:
            pass
        del raw


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
