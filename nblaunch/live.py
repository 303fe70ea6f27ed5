"""Live ranks: ranks that stay up across cells, each keeping its state.

    ranks = nblaunch.start(num_processes=4)   # ranks up, process group made
    ranks.run(setup)                          # `global model` in setup ...
    ranks.run(train, 3)                       # ... is `model` here
    ranks.pull("model", rank=0)
    ranks.close()

:class:`Ranks` is the user's handle on a live :class:`~nblaunch.session.Session`:
it checks each call, takes the kernel's one launch slot for it, and ends
the session when closed, collected, or when the kernel ends. What a failed
call does to the ranks is the session's (see :mod:`nblaunch.session`).
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

from . import registry
from .config import LaunchConfig, check_call, check_call_options
from .errors import LaunchError, refuse_inside_a_rank
from .rank import namespace
from .rank.spec import current_spec
from .session import Session, one_at_a_time
from .watch.call import ranks_label
from .wire.payload import check_sendable

__all__ = ["start", "Ranks", "active"]

def active() -> Optional["Ranks"]:
    """This kernel's open live session, if any."""
    ranks = registry.live_ranks()
    return ranks if ranks is not None and ranks.is_up else None


class _EndSession:
    """The session, for the finalizer (which must not hold the ``Ranks``)."""

    def __init__(self, session: Session):
        self.session = session

    def close(self) -> None:
        self.session.end()


class Ranks:
    """Ranks that stay up between cells; made by :func:`start`.

    ``run(fn, *args, **kwargs)`` runs ``fn`` on every rank, in each rank's own
    namespace, with a launch's live view, and returns the per-rank results
    (or raises :class:`~nblaunch.WorkerError`, ``LaunchTimeout``,
    ``KeyboardInterrupt``). ``pull``/``push`` move named objects out of and
    into the ranks. ``close()`` ends them (so does the kernel's end, and this
    object being garbage collected). ``status`` says what is up.
    """

    def __init__(self, config: LaunchConfig):
        made: list = []  # the session from its first line: a press as it returned left it in flight
        try:
            self._session = Session(config, live=True, kept_in=made)
            self._finalizer = weakref.finalize(self, _EndSession(self._session).close)
            self._closed = False
            self._session.open()
            registry.set_live_ranks(self)  # here: a press as start() got them left them up unknown to it
        except BaseException:
            if hasattr(self, "_finalizer"):
                self._finalizer.detach()
            for session in made:
                session.end()
            raise

    # -- public -------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, display: Optional[str] = None,
            **kwargs):
        """``fn(*args, **kwargs)`` on every rank; returns ``[result of rank 0, ...]``.

        ``fn`` sees the rank's namespace: names it binds with ``global`` stay
        for later calls; names it uses from the notebook come with it, unless
        the rank bound that name itself (the rank's value wins). ``timeout``
        and ``display`` are this call's (see ``notebook_launcher``); to pass
        an argument of those names to ``fn``, use ``functools.partial``."""
        args, kwargs = check_call(fn, args, kwargs)
        check_call_options(timeout, display or "auto")
        return self._call(_pack(fn, tuple(args), kwargs), timeout, display or self._session.config.display, True)

    def pull(self, name: str, rank: Optional[int] = None):
        """The object bound to ``name`` in rank ``rank`` (None: a list, one per
        rank). Tensors come through shared memory; a module or optimizer is
        pulled as a copy (its ``state_dict()`` is usually what you want)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be an identifier, got {name!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.num_processes):
            raise ValueError(f"rank must be None or an int in [0, {self.num_processes}), got {rank!r}")
        results = self._call(_pack(_pull_on, (name, rank), {}), None, "none", False)
        return list(results) if rank is None else results[rank]

    def push(self, **values) -> None:
        """Bind ``values`` by name in every rank (a copy each), replacing what a rank had."""
        self._call(_pack(namespace.push, (values,), {}), None, "none", False)

    def restart(self) -> None:
        """End the ranks and start new ones (their state is lost)."""
        self._check_usable()
        with one_at_a_time():
            self._session.restart()

    def grow(self) -> list:
        """Take in the nodes that came back (``min_nodes``: a node lost, or left
        out, that has been usable for ``node_back_after`` seconds, up to
        ``max_nodes``; a ``run`` says when there is one): the ranks are
        restarted on every node, so what they hold is lost. Returns the
        nodes taken in; none were back: ``[]``, and the ranks are left alone."""
        self._check_usable()
        with one_at_a_time():
            return self._session.grow()

    def close(self) -> None:
        """End the ranks. Closing twice is fine."""
        self._closed = True
        self._session.end()

    @property
    def restarts(self) -> int:
        """How many times the ranks were replaced (settable: a count of your own)."""
        return self._session.restarts

    @restarts.setter
    def restarts(self, value: int) -> None:
        self._session.restarts = value

    @property
    def num_processes(self) -> int:
        """The ranks up (fewer than at first once a lost node was left out: ``min_nodes``)."""
        return self._session.world_size

    @property
    def is_up(self) -> bool:
        return not self._closed and self._session.pool is not None

    @property
    def pids(self) -> list[int]:
        pool = self._session.pool
        return list(pool.pids) if pool is not None else []

    @property
    def status(self) -> str:
        """``up``, ``closed``, or what is wrong; with the ranks, calls and restarts."""
        session = self._session
        pool = session.pool
        if self._closed or pool is None:
            return "closed"
        dead = [pool.global_rank(r) for r in range(pool.size) if not pool.up_now(r)]
        engine = session.engine
        what = f"{self.num_processes} ranks ({engine.method}, {engine.backend or 'no process group'})"
        lost = "; ".join(pool.lost_nodes.values())
        if dead:
            return f"down: {lost or ranks_label(dead) + ' ended'} outside a call; {session.next_run_restarts()} | {what}"
        restarts = f", restarted {session.restarts}x" if session.restarts else ""
        return f"up: {what}, {session.runs} calls{restarts} | output: {pool.log_dir}"

    def __repr__(self) -> str:
        return f"<nblaunch.Ranks {self.status}>"

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise LaunchError("these live ranks were closed; start new ones with nblaunch.start()")
        refuse_inside_a_rank("a call on live ranks")

    def _call(self, job: bytes, timeout: Optional[float], display: str, counted: bool):
        self._check_usable()
        with one_at_a_time():
            return self._session.call(job, timeout, display, counted)


def _pack(fn, args: tuple, kwargs: dict) -> bytes:
    try:
        return namespace.pack_call(fn, args, kwargs)
    except Exception:
        check_sendable(fn, args, kwargs)  # names the part that cannot be sent
        raise


def _pull_on(name: str, rank: Optional[int]):
    """In each rank: the named object from the one asked (None from the others)."""
    if rank is not None and current_spec().rank != rank:
        return None
    return namespace.pull(name)


def start(num_processes: int, *, start_method: str = "auto", backend: str = "auto",
          init_process_group: bool = True, master_addr: Optional[str] = None,
          threads_per_rank: Optional[int] = None, display: str = "auto",
          stall_warning: Optional[float] = 60.0, cluster=None, num_nodes: int = 1,
          min_nodes: Optional[int] = None, node_lost_after: Optional[float] = None,
          max_nodes: Optional[int] = None, node_back_after: float = 10.0) -> Ranks:
    """Start ``num_processes`` ranks that stay up across cells; returns :class:`Ranks`.

    The ranks get what a ``notebook_launcher`` rank gets (torchrun's
    environment, a process group, the rank's device) once, then wait for
    ``run`` calls. One session per kernel at a time; ``notebook_launcher``
    still works while one is up (not at the same moment as a call). Use it as
    a context manager, or ``close()`` it; it also ends with the kernel.
    ``cluster="slurm"`` (and ``num_nodes``): ranks on the nodes of a SLURM
    allocation, as ``notebook_launcher`` has them; ``min_nodes``: when a
    node is lost, the ranks are restarted on the nodes still up if at least
    this many (the next run says so); ``node_lost_after``: seconds without a
    heartbeat before a node is lost, between calls too (``notebook_launcher``'s).
    Live ranks never grow unasked: once a node left out is usable again for
    ``node_back_after`` seconds (up to ``max_nodes``), the next ``run`` says
    so, and :meth:`Ranks.grow` takes it in.
    """
    config = LaunchConfig(num_processes, start_method=start_method, backend=backend,
                          init_process_group=init_process_group, master_addr=master_addr,
                          threads_per_rank=threads_per_rank, display=display, stall_warning=stall_warning,
                          cluster=cluster, num_nodes=num_nodes, min_nodes=min_nodes,
                          node_lost_after=node_lost_after, max_nodes=max_nodes, node_back_after=node_back_after)
    refuse_inside_a_rank("nblaunch.start")
    up = active()
    status = up.status if up is not None else None
    del up  # a traceback kept by IPython must not keep the session alive
    if status is not None:
        raise LaunchError(f"live ranks are already up in this kernel ({status}); "
                          "close them first (ranks.close() or %nblaunch stop)")
    with one_at_a_time():
        return Ranks(config)
