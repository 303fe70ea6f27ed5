"""What runs inside one rank.

Order matters and is the contract: watch for the kernel's death, take over
file descriptors 1/2, set the torchrun environment, report ``Started``, set up
the process group, load and run ``fn``, report ``Result`` or ``Failure``, tear
down, and leave with ``os._exit`` (never through interpreter shutdown, which
can hang on threads or atexit handlers the kernel left in a forked child).
"""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import functools
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from .. import linux, progress
from . import env as rank_env, stacks
from ..wire.channel import CLOSE, RELEASE, Call, EventSender, Failure, Phase, Result, Started
from .frames import is_machinery

__all__ = ["WorkerSpec", "run_worker", "current_spec"]

_PARENT_POLL_S = 0.2
_LINGER_AFTER_FAILURE_S = 2.0

_current: Optional["WorkerSpec"] = None


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to know about its place in the launch."""

    rank: int  # global; until the go message, the local rank
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    kernel_pid: int
    backend: Optional[str]  # None: fn initialises the process group itself
    threads: int
    pg_timeout_s: float
    env: dict = field(default_factory=dict)  # extra variables for this rank
    master_port: int = 0  # set by the go message
    stack_file: str = ""  # where faulthandler dumps this rank's stacks on SIGUSR1
    group_rank: int = 0  # this node's rank
    num_nodes: int = 1
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "none"
    # What the rank recreates of the kernel (see rank_env): its environment
    # at launch time (None: this process's own) and its root logging set-up.
    environ: Optional[dict] = None
    logging_setup: tuple = ()
    live: bool = False  # a live session's rank: serves calls until told to close
    forked: bool = False  # started by fork: it inherited the kernel's memory (and the job)
    kernel_facts: Optional[dict] = None  # rank_env.kernel_facts(), looked up in the kernel before a fork
    interrupt_file: str = ""  # a live rank: which call the kernel's SIGINT is for


def current_spec() -> Optional[WorkerSpec]:
    """The spec of the rank this code runs in, or None outside a launch."""
    return _current


def run_worker(spec: WorkerSpec, job: Any, go: Connection, events: Connection,
               output: Connection, parent: Optional[int] = None) -> None:
    """Entry point of a rank process. ``go`` delivers the rank's place in the
    job (global rank, world size, where the ranks' store is) once every rank
    has been started and the nodes have met. Then the rank serves calls
    (:func:`_serve`): a launch's rank exactly one, ``job`` (``(fn, args,
    kwargs)``, or a ``payload.PackedJob`` of them when the rank was not
    forked); a live rank (``spec.live``, ``job`` None) those the kernel sends
    until it says ``CLOSE``, after reporting its set-up as call 0. Events
    name the rank by its local rank: the kernel knows the rest. ``parent``:
    the process that started this one, when it may already be gone (a rank
    forked by :mod:`nblaunch.engines.zygote`)."""
    global _current
    if _prepared is None:
        _default_stop_signals()
    _watch_parent(spec.kernel_pid, os.getppid() if parent is None else parent)
    _point_fds(output)
    if _prepared is None:
        _become_rank(spec)
    elif _prepared_said:
        os.write(2, _prepared_said)
    if isinstance(_prepared, BaseException):  # said here, where the rank's stderr is the kernel's pipe
        raise _prepared
    if spec.stack_file:
        stacks.register(spec.stack_file)
    sender = EventSender(events)
    local = spec.local_rank
    progress.begin_rank(sender, local)
    made_group = False
    try:
        os.setpgid(0, 0)  # own process group: the kernel's SIGINT is the kernel's to handle
        _leads_group.set()
        spec = dataclasses.replace(spec, **go.recv())  # go stays open for RELEASE and calls
        _current = spec
        os.environ.update(_torchrun_env(spec))
        os.environ.update(_slurm_env(spec, os.environ))
        os.environ.update(spec.env)
        sender.send(Started(local, os.getpid(), time.time()))
        made_group = _setup_torch(spec, sender)
        if spec.live:
            sender.send(Result(local, pickle.dumps(None), call=0, seq=_group_seq()))
    except BaseException as exc:  # noqa: BLE001 - every failure must be reported
        _report(sender, local, "setup", exc)
        _linger_and_leave()
    calls = _calls_from(go) if spec.live else iter([Call(0, job)])
    if not _serve(spec, sender, go, calls) and not spec.live:
        _linger_and_leave()
    if made_group:
        _destroy_group()
    _leave(0)


def _linger_and_leave() -> None:
    """After a failure that ends the rank: stay up until the kernel stops
    every rank. Exiting now would close our sockets and hand the peers a
    "Connection closed by peer" error of their own before the kernel has
    stopped them."""
    time.sleep(_LINGER_AFTER_FAILURE_S)
    _leave(1)


def _calls_from(go: Connection):
    """A live rank's calls, as the kernel sends them, until ``CLOSE``."""
    while True:
        try:
            msg = go.recv()
        except EOFError:
            return
        if msg == RELEASE:  # the kernel took a result that needed no wait
            continue
        if msg == CLOSE or not isinstance(msg, Call):
            return
        yield msg


def _serve(spec: WorkerSpec, sender: EventSender, go: Connection, calls) -> bool:
    """Run each call, report its end (``Result`` or ``Failure``), and return
    whether the last one succeeded. A live rank runs it in its own namespace
    (:mod:`nblaunch.rank.namespace`), where an exception ends the call, not the
    rank. The kernel interrupts a live call (its interrupt button, or another
    rank's failure) by writing the call's number to ``interrupt_file`` and
    sending SIGINT: a ``KeyboardInterrupt`` in the call's function, raised as
    the function starts if the call was still loading. A SIGINT for a call
    that has ended is ignored, so it never lands in the next call or in a
    report."""
    from . import namespace

    ns = namespace.current() if spec.live else None
    interrupt = _CallInterrupt(spec.interrupt_file)
    if spec.interrupt_file:
        signal.signal(signal.SIGINT, interrupt.handler)
    ok = True
    for call in calls:
        interrupt.begin(call.id)
        progress.new_call(call.id)
        _call_timeout(spec, call.timeout)
        phase = "load"
        try:
            fn, args, kwargs = ns.load(call.job) if ns is not None else _load(spec, call.job)
            phase = "fn"
            exited = False
            try:
                interrupt.running = True
                sender.send(Phase(spec.local_rank, "in fn", call=call.id))
                if interrupt.pending or interrupt.asked():  # it came while the call was loading
                    raise KeyboardInterrupt
                value = fn(*args, **kwargs)
            except SystemExit as exc:  # sys.exit(0) in a rank is an ordinary return
                if exc.code not in (None, 0):
                    raise
                value, exited = None, True
            finally:
                interrupt.running = False
            ended = time.time()
            interrupt.end()
            if ns is not None:
                ns.forget()
            phase = "result"
            payload, shared = _dump_result(spec.rank, value)
            _check_size(spec.rank, value, len(payload) + shared)
            progress.finish_call()
            sender.send(Result(spec.local_rank, payload, shared, call=call.id, seq=_group_seq(), time=ended,
                               exited=exited))
            del value
            if shared:  # keep the storages alive until the kernel has them
                _await_release(go)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - every failure must be reported
            interrupt.end()
            if ns is not None:
                ns.forget()
            try:
                progress.finish_call()
            except Exception:
                pass
            _report(sender, spec.local_rank, phase, exc, call=call.id, seq=_group_seq())
            del exc
            ok = False
    return ok


def _await_release(go: Connection) -> None:
    """Until the kernel has fetched this result's shared memory (or died, and so do we)."""
    try:
        while go.recv() != RELEASE:
            pass
    except (EOFError, OSError):
        pass


def _call_timeout(spec: WorkerSpec, timeout: Optional[float]) -> None:
    """A live call's collectives give up a little after the call's own
    timeout (as a launch's do), so the kernel's timeout, with every rank's
    stack, comes first; without one, torch's default. Through a private
    torch call (``_set_pg_timeout``, torch >= 2.3): there is no public one,
    and a process group's timeout is otherwise fixed when it is made."""
    if not spec.live or spec.backend is None:
        return
    try:
        import torch.distributed as dist

        from ..engines.plan import pg_timeout_for

        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=pg_timeout_for(timeout)))
    except Exception:  # an older torch: the group keeps the timeout it was made with
        pass


class _CallInterrupt:
    """A live rank's SIGINT handler. A signal carries no data, so which call
    it is for is in a file the kernel writes first: only the call this rank
    is on can be interrupted; a late signal for an ended call is ignored."""

    def __init__(self, path: str):
        self._path = path
        self._call: Optional[int] = None
        self.running = False  # the call's function is running: raise there
        self.pending = False  # asked while the call was loading

    def begin(self, call: int) -> None:
        self._call, self.pending, self.running = call, False, False

    def end(self) -> None:
        self._call, self.pending, self.running = None, False, False

    def asked(self) -> Optional[str]:
        """How the kernel asked this call to stop: ``"now"``, ``"at a step"``
        (the stop button: see :func:`nblaunch.progress.stop_at_a_step`), or
        None when it asked for another call (or not at all)."""
        if self._call is None or not self._path:
            return None
        try:
            with open(self._path) as f:
                call, _, how = f.read().strip().partition(" ")
        except OSError:
            return None
        return (how or "now") if call == str(self._call) else None

    def handler(self, signum, frame) -> None:
        how = self.asked()
        if how is None:
            return
        if self.running:
            if how == "at a step" and _StepAgreement.possible() and progress.stop_at_a_step(
                    functools.partial(_StepAgreement.for_call, self._call)):
                return  # the KeyboardInterrupt comes at the agreed step
            raise KeyboardInterrupt
        self.pending = True


class _StepAgreement:
    """How the ranks of one live call agree on the loop step at which they
    all stop, through the ranks' store (the kernel's; no collective, which
    could pair with the user's own). Each rank, from the moment its SIGINT
    is handled, offers its step count at every step. Once every rank has
    offered, the first rank to see it fixes the stop step at one past the
    highest count offered (first writer wins, ``compare_set``). A rank
    offers before it reads, and its count only grows at a step, so no rank
    is past the step when it learns it; ranks in lockstep (DDP) reach it
    together. No anchor does this: torchrun, accelerate and ipyparallel
    interrupt wherever each rank happens to be."""

    _made: dict = {}  # call -> its agreement, made at this rank's first step after the signal

    def __init__(self, store, key: str, rank: int, world_size: int):
        self._store, self._key, self._rank, self._world = store, key, rank, world_size

    @staticmethod
    def possible() -> bool:
        """Only with a process group: without one there are no peers to stay in step with."""
        torch = sys.modules.get("torch")
        return _current is not None and torch is not None and torch.distributed.is_initialized()

    @classmethod
    def for_call(cls, call: int) -> "_StepAgreement":
        if call not in cls._made:
            import torch.distributed as dist

            cls._made = {call: cls(_ranks_store(), f"nblaunch/stop/{_current.restart_count}/{call}",
                                   dist.get_rank(), dist.get_world_size())}
        return cls._made[call]

    def offer(self, steps: int) -> Optional[int]:
        """Record this rank's count; the agreed stop step once there is one."""
        store, key = self._store, self._key
        store.set(f"{key}/{self._rank}", str(steps))
        if store.check([f"{key}/at"]):
            return int(store.get(f"{key}/at"))
        offered = [f"{key}/{rank}" for rank in range(self._world)]
        if not store.check(offered):
            return None
        highest = max(int(store.get(k)) for k in offered)
        return int(store.compare_set(f"{key}/at", "", str(highest + 1)))


def _group_seq() -> int:
    """How many collectives this rank has issued on the default process group
    (-1: no group, or torch cannot say). After a call that did not end well
    everywhere, ranks that disagree are out of step: their next collective
    would pair with the wrong peer operation."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return -1
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return -1


_janitor_pipe: Optional[int] = None
# Set once this rank leads its own process group, the one its janitor ends.
_leads_group = threading.Event()


def _has_children() -> bool:
    """Whether any thread of this process has a child (Linux, without
    scanning the whole process table)."""
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                if f.read().strip():
                    return True
    except OSError:
        return False
    return False


def _start_janitor() -> None:
    """Start :mod:`nblaunch.rank.janitor` for this rank (Linux): it ends what the
    rank started if the rank dies with its kernel. It gets the read end of a
    pipe whose write end this rank keeps until it dies. Called by the
    parent-watch thread once the rank has children."""
    global _janitor_pipe
    if not sys.platform.startswith("linux"):
        return
    import subprocess

    read, write = os.pipe()
    import nblaunch

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(nblaunch.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    try:
        subprocess.Popen([sys.executable, "-m", "nblaunch.rank.janitor", str(os.getpid()), str(read)],
                         pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    except OSError:
        os.close(write)
        write = -1  # no janitor for this rank; do not try again every poll
    finally:
        os.close(read)
    _janitor_pipe = write


def _default_stop_signals() -> None:
    """Let SIGTERM, SIGHUP and SIGQUIT end this rank at once, whatever Python
    handlers the kernel had. A forked rank inherits them, and a kernel may
    well have some: torch elastic (so accelerate's launcher) leaves its
    handler for all three in the kernel after its first launch. A Python handler only
    runs between bytecodes, so a rank blocked in a collective would outlive
    SIGTERM and be stopped only by the SIGKILL that follows the grace period
    (measured: a failure took 0.33 s instead of 0.02 s to reach the cell).
    ``fn`` may still install its own handlers."""
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)


def _watch_parent(kernel_pid: int, parent: int) -> None:
    """Die with the kernel: a kernel-side signal, plus a poll that catches a
    parent that died before the signal was armed (or a forkserver parent)."""
    if sys.platform.startswith("linux") and linux.prctl is not None:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        # Orphans of what fn starts (a double fork, a daemon) become this
        # rank's children rather than init's, so the rank can end them.
        linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)

    kernel_alive = _process_watch(kernel_pid)

    def alive() -> bool:
        # Under forkserver our parent is not the kernel: look at the kernel too.
        return os.getppid() == parent and kernel_alive()

    if not alive():
        os._exit(1)

    def poll() -> None:
        while alive():
            time.sleep(_PARENT_POLL_S)
            # The janitor costs a fresh interpreter per rank (40 ms of a
            # 2-rank launch on 2 CPUs, measured), so it starts only once
            # the rank has a child to look after.
            if _janitor_pipe is None and _leads_group.is_set() and _has_children():
                _start_janitor()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=poll, name="nblaunch-parent-watch", daemon=True).start()


def _process_watch(pid: int) -> Callable[[], bool]:
    """A cheap "is it still running?" for the kernel. A killed kernel stays a
    zombie until the Jupyter server reaps it, which counts as ended. On Linux
    a pidfd (bound to that very process, readable once it has ended): psutil
    would run far more code in every forked rank, and each first run of
    inherited code copies pages of the kernel's (about 0.4 MiB per rank)."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: False
    except (AttributeError, OSError):  # not Linux >= 5.3
        fd = -1
    if fd >= 0:
        return lambda: not select.select([fd], [], [], 0)[0]
    import psutil

    try:
        kernel = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return lambda: False

    def alive() -> bool:
        try:
            return kernel.is_running() and kernel.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return alive


# None: this process is not ready to be a rank; True: it is (a rank forked
# by nblaunch.engines.zygote, which made itself ready once for all its ranks); an
# exception: making it ready failed, and each rank raises it.
_prepared: Any = None
_prepared_said = b""  # what making it ready wrote on fds 1/2: each rank writes it on its own


def prepare_for_ranks(spec: WorkerSpec) -> None:
    """Everything of becoming a rank that is the same for every rank of a
    generation, done in :mod:`nblaunch.engines.zygote`'s process before it forks
    them (the rest follows in :func:`run_worker`). What it writes (a shim
    that could not adapt a library says so) is kept for the ranks' output;
    this process's fds 0-2 are /dev/null afterwards."""
    global _prepared, _prepared_said
    import tempfile

    _default_stop_signals()
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 1)
        os.dup2(said.fileno(), 2)
        try:
            _become_rank(spec)
            _prepared = True
        except BaseException as exc:  # noqa: BLE001 - each rank reports it
            _prepared = exc
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        said.seek(0)
        _prepared_said = said.read()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _become_rank(spec: WorkerSpec) -> None:
    old_streams = _own_streams()
    rank_env.become_rank(spec.environ if spec.environ is not None else rank_env.rank_environ(),
                         old_streams, spec.logging_setup, forked=spec.forked, kernel_facts=spec.kernel_facts)


def _point_fds(output: Connection) -> None:
    """Point fds 1 and 2 at the kernel's output pipe for this rank, and fd 0
    at /dev/null."""
    fd = output.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    output.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _own_streams() -> tuple:
    """Give Python line-buffered streams on fds 0-2 (the kernel's own
    streams, inherited through fork, would talk to the kernel's sockets).
    Returns the streams ``sys.stdout``/``sys.stderr`` were before."""
    old = (sys.stdout, sys.stderr)

    def stream(num: int) -> io.TextIOWrapper:
        raw = open(num, "wb", closefd=False)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True)

    sys.stdout = sys.__stdout__ = stream(1)
    sys.stderr = sys.__stderr__ = stream(2)
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    return old


def _torchrun_env(spec: WorkerSpec) -> dict[str, str]:
    env = {
        "RANK": spec.rank,
        "LOCAL_RANK": spec.local_rank,
        "WORLD_SIZE": spec.world_size,
        "LOCAL_WORLD_SIZE": spec.local_world_size,
        "GROUP_RANK": spec.group_rank,
        "NODE_RANK": spec.group_rank,
        "GROUP_WORLD_SIZE": spec.num_nodes,
        "ROLE_NAME": "default",
        "ROLE_RANK": spec.rank,
        "ROLE_WORLD_SIZE": spec.world_size,
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": spec.master_port,
        # The kernel hosts the TCPStore (bound to a free port it chose, so two
        # launches can never race for one); env:// then makes every rank a
        # client of it, exactly as under torchrun's agent.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": spec.restart_count,
        "TORCHELASTIC_MAX_RESTARTS": spec.max_restarts,
        "TORCHELASTIC_RUN_ID": spec.run_id,
        "OMP_NUM_THREADS": spec.threads,
        "NBLAUNCH_RANK": spec.rank,
    }
    return {k: str(v) for k, v in env.items()}


# SLURM's per-task variables, and what each must say in a rank.
_SLURM_TASK_VARS = {
    "SLURM_PROCID": lambda s: s.rank,
    "SLURM_LOCALID": lambda s: s.local_rank,
    "SLURM_NODEID": lambda s: s.group_rank,
    "SLURM_NTASKS": lambda s: s.world_size,
    "SLURM_NPROCS": lambda s: s.world_size,
    "SLURM_STEP_NUM_TASKS": lambda s: s.world_size,
    "SLURM_NTASKS_PER_NODE": lambda s: s.local_world_size,
    "SLURM_STEP_TASKS_PER_NODE": lambda s: s.local_world_size,
    "SLURM_TASKS_PER_NODE": lambda s: s.local_world_size,
    "SLURM_NNODES": lambda s: s.num_nodes,
    "SLURM_STEP_NUM_NODES": lambda s: s.num_nodes,
    "SLURM_GTIDS": lambda s: ",".join(str(s.rank - s.local_rank + i) for i in range(s.local_world_size)),
}


def _slurm_env(spec: WorkerSpec, environ) -> dict[str, str]:
    """A kernel inside a SLURM job (a Jupyter server started by ``srun`` or
    batchspawner) has one task's variables: every rank would inherit
    ``SLURM_PROCID=0`` and ``SLURM_NTASKS=1``, and code that trusts SLURM
    (Lightning's and submitit's environments, ignite) would give every rank
    the same number. Those the kernel has are rewritten to agree with
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the node; the job's own
    variables (its id, its allocation) are kept."""
    return {name: str(value(spec)) for name, value in _SLURM_TASK_VARS.items() if name in environ}


def _setup_torch(spec: WorkerSpec, sender: EventSender) -> bool:
    """Threads, device and process group. Returns True if a group was made."""
    if "torch" not in sys.modules:  # spawn, forkserver without its preload: seconds on a busy machine
        sender.send(Phase(spec.local_rank, "importing torch"))
    import torch

    progress.torch_imported()
    torch.set_num_threads(spec.threads)
    if torch.cuda.is_available() and spec.local_rank < torch.cuda.device_count():
        torch.cuda.set_device(spec.local_rank)
    if spec.backend is None:
        return False
    import torch.distributed as dist

    sender.send(Phase(spec.local_rank, "joining the process group"))
    dist.init_process_group(
        backend=spec.backend,
        init_method="env://",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
    )
    _joined_store(spec, add=1)
    return True


_JOINED_WAIT_S = 30.0


def _joined_store(spec: WorkerSpec, add: int) -> int:
    """Count this rank in (``add=1``), or read (``add=0``), how many ranks
    have made the process group, on the ranks' store (hosted by the kernel,
    so it outlives every rank). Returns the count; -1 without a store."""
    try:
        return int(_ranks_store().add(f"nblaunch/joined/{spec.restart_count}", add))
    except Exception:  # a backend without a default store: nothing to wait for
        return -1


def _ranks_store():
    """The store the ranks made their process group through (the kernel's
    TCPStore, under the group's prefix). torch has no public accessor."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _wait_for_peers_joined(spec: WorkerSpec) -> None:
    """gloo's init connects every pair of ranks, and a rank is through once
    its own pairs are: a rank whose fn returns at once could tear its pairs
    down while a slower peer is still connecting ("Gloo connectFullMesh
    failed ... Connection closed by peer", seen under load). It leaves only
    once every rank has made the group (bounded: a peer that never does is
    the kernel's to report)."""
    deadline = time.monotonic() + _JOINED_WAIT_S
    delay = 0.001
    while 0 <= _joined_store(spec, add=0) < spec.world_size and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


def _load(spec: WorkerSpec, job: Any) -> tuple:
    """A rank forked from the kernel inherits the job as objects; other ranks
    (and ranks a node agent forked) get it packed."""
    return job if isinstance(job, tuple) else job.load()


def _dump_result(rank: int, value: Any) -> tuple[bytes, int]:
    """``(payload, bytes of tensor data put in shared memory)``. Tensors go
    through torch's own multiprocessing reductions (as ``args`` do under
    spawn), so a 512 MB state_dict is never pickled into bytes, here or in
    the kernel."""
    from multiprocessing.reduction import ForkingPickler

    shared = _count_shared(ForkingPickler._extra_reducers)
    try:
        buf = io.BytesIO()
        pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = shared.table(pickler.dispatch_table)
        pickler.dump(value)
        return buf.getvalue(), shared.nbytes
    except Exception:
        pass
    from ..wire.payload import sharing_pickler  # classes defined in the cell, closures...

    shared = _count_shared(ForkingPickler._extra_reducers)
    try:
        buf = io.BytesIO()
        pickler = sharing_pickler(buf)
        pickler.dispatch_table = shared.table(pickler.dispatch_table)
        pickler.dump(value)
        return buf.getvalue(), shared.nbytes
    except Exception as exc:
        raise TypeError(
            f"the result of rank {rank} (a {type(value).__module__}.{type(value).__qualname__}) "
            f"cannot be pickled: {exc}"
        ) from None


class _count_shared:
    """Wraps torch's storage reducers to add up what they put in shared
    memory, each storage once (a typed storage is reduced through its
    untyped one; views share a storage). CUDA tensors are sent as a CPU copy
    in shared memory and rebuilt on the same device in the kernel: torch's
    CUDA IPC would hand the kernel memory that dies with the rank."""

    def __init__(self, reducers: dict):
        import torch

        self.nbytes = 0
        self._seen: set = set()
        self._wrapped = {cls: self._wrap(reduce) for cls, reduce in reducers.items()
                         if "Storage" in getattr(cls, "__name__", "")}
        self._wrapped.update({cls: self._cuda_as_cpu(reduce) for cls, reduce in reducers.items()
                              if isinstance(cls, type) and issubclass(cls, torch.Tensor)})

    @staticmethod
    def _cuda_as_cpu(reduce):
        def reduce_tensor(tensor):
            if tensor.is_cuda:
                return (_cuda_from_cpu, (tensor.detach().cpu(), tensor.device.index, tensor.requires_grad))
            return reduce(tensor)
        return reduce_tensor

    def _wrap(self, reduce):
        def counted(storage):
            untyped = getattr(storage, "_untyped_storage", storage)
            if untyped.data_ptr() not in self._seen:
                self._seen.add(untyped.data_ptr())
                self.nbytes += untyped.nbytes()
            return reduce(storage)
        return counted

    def table(self, base) -> dict:
        table = dict(base)
        table.update(self._wrapped)
        return table


def _cuda_from_cpu(tensor, device: int, requires_grad: bool):
    """In the kernel: a rank's CUDA tensor, back on its device."""
    return tensor.to(f"cuda:{device}").requires_grad_(requires_grad)


def max_result_bytes() -> int:
    """Largest pickled result a rank may send (``$NBLAUNCH_MAX_RESULT_BYTES``,
    default 2 GiB): the kernel holds every rank's result in memory at once, so
    a bigger one fails that rank with a clear error instead of the kernel."""
    return int(os.environ.get("NBLAUNCH_MAX_RESULT_BYTES", 2 << 30))


def _check_size(rank: int, value: Any, size: int) -> None:
    limit = max_result_bytes()
    if size > limit:
        raise ValueError(
            f"the result of rank {rank} (a {type(value).__qualname__}) is {size:,} bytes, "
            f"over the {limit:,}-byte limit (NBLAUNCH_MAX_RESULT_BYTES). Return something smaller, "
            "or save large outputs to disk and return their paths.")


def _report(sender: EventSender, rank: int, phase: str, exc: BaseException, call: int = 0,
            seq: int = -1) -> None:
    try:
        pickled: Optional[bytes] = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pickled = None
    failure = Failure(
        rank=rank,
        time=time.time(),
        exc_type=type(exc).__qualname__,
        message=_safe_str(exc),
        traceback=_format_user_traceback(exc),
        exception=pickled,
        phase=phase,
        call=call,
        seq=seq,
    )
    try:
        sender.send(failure)
    except Exception:
        # The kernel is gone or the pipe broke: the traceback still goes to
        # the output pipe, which the kernel reads to the end.
        sys.stderr.write(failure.traceback)


def _safe_str(exc: BaseException) -> str:
    """``str(exc)``, even for an exception whose ``__str__`` raises."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<str() of the exception failed: {type(inner).__name__}: {inner}>"


def _format_user_traceback(exc: BaseException) -> str:
    """The traceback as the user would see it running fn in the cell:
    nblaunch's own frames (this module above fn, the magic's cell runner)
    are left out, unless the error was raised in nblaunch itself."""
    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        _drop_machinery(te, set())
        return "".join(te.format())
    except Exception:  # a __str__ that raises: the frames still tell where
        summary = _user_frames(traceback.extract_tb(exc.__traceback__))
        frames = "".join(traceback.format_list(summary))
        return f"Traceback (most recent call last):\n{frames}{type(exc).__qualname__}: {_safe_str(exc)}\n"


def _user_frames(stack: traceback.StackSummary) -> traceback.StackSummary:
    kept = [f for i, f in enumerate(stack) if not is_machinery(f.filename) or i == len(stack) - 1]
    return traceback.StackSummary.from_list(kept)


def _drop_machinery(te: traceback.TracebackException, seen: set) -> None:
    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = _user_frames(te.stack)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _drop_machinery(chained, seen)


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if _current is not None:
            _wait_for_peers_joined(_current)
        dist.destroy_process_group()


def _end_children() -> None:
    """A rank's processes end with it, as under torchrun's process group
    kill: whatever fn started and left running (a server, a `sleep`, a
    daemon that is now our child as we are its subreaper)."""
    if not _has_children():  # the usual case, without scanning the process table
        return
    import psutil

    for _ in range(5):  # a killed child's own orphans come to us next
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if not children:
            return
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=1.0)


def _leave(code: int) -> None:
    try:
        _end_children()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # C stdio too: printf from a C extension sits in libc's buffer (fully
    # buffered on a pipe), which os._exit would throw away.
    if linux.fflush is not None:
        linux.fflush(None)
    os._exit(code)
