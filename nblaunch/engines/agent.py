"""A node agent: ``python -m nblaunch.engines.agent``, one per node of a cluster launch.

The cluster engine starts it (SLURM's ``srun``; a Ray actor), with the
kernel's address and the launch's secret in its environment. It connects
(:mod:`nblaunch.wire.link`), says which node it is, receives the launch (the
config, the job, where its ranks sit in the job), starts its node's ranks
as a :class:`~nblaunch.engines.pool.LocalPool` does on one machine (fork, from this
fresh process that never ran OpenMP or CUDA), and then relays: what the
ranks send and print goes to the kernel as the pool reports it, and the
kernel's verbs (send, signal, interrupt, stacks, stop, drain, close) are
applied to the pool. When the kernel goes away (its connection closes, the
kernel was killed), stops answering (no heartbeat for the lost-after time:
:mod:`nblaunch.wire.beats`), says this node was dropped (it was found silent
and the run went on without it), or the step is interrupted (SIGINT), it
stops its ranks and leaves: nothing outlives the launch on any node. SIGTERM and SIGUSR1
(SLURM's notice that the job ends) are passed on as a preemption notice.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..wire import agent_messages as msg

__all__ = ["main", "Placed", "relayable"]

# What the node's ranks report as they go is sent to the kernel at most this
# often, in one message for the whole node (engines.pipes.coalesce): the
# kernel's cost then grows with the nodes, not with every rank's reports.
RELAY_TICK_S = 0.1
# Between reports the relay sleeps until something happens (a rank's pipe,
# the kernel's link, a signal's wake-up byte) or the next resource sample is
# due; it woke 20 times a second, ~8 ms of CPU a second on every node.
IDLE_WAKE_S = 1.0
# Cut off from the kernel, the relay stops the ranks and leaves; if it cannot
# (blocked sending to a kernel that no longer reads), the ranks are killed
# and the agent exits this long after.
CUT_OFF_EXIT_S = 5.0


class Placed:
    """The node's place in the job, decided by the kernel (``nodes.Nodes``)."""

    def __init__(self, placement):
        self.placement = placement
        self.num_nodes = 1  # joined already: nothing to wait for here

    def join(self, attempt: int):
        return self.placement

    def publish(self, failure) -> None:
        pass

    def poll(self, force: bool = False):
        return None

    def finish(self, succeeded: bool):
        return None

    def close(self) -> None:
        pass


def relayable(item: Any, pool) -> Any:
    """A pool event as it can cross to another machine: a result whose
    tensors sit in this node's shared memory is fetched here and pickled by
    value (the rank is then released)."""
    from ..wire.channel import RELEASE, Result
    from .pool import Message

    if not (isinstance(item, Message) and isinstance(item.event, Result) and item.event.shared):
        return item
    import cloudpickle

    event = item.event
    try:
        payload = cloudpickle.dumps(pickle.loads(event.payload))
    except Exception:  # noqa: BLE001 - the kernel's unpickling then says what is wrong
        payload = event.payload
    finally:
        pool.send(item.rank, RELEASE)
    return Message(item.rank, dataclasses.replace(event, payload=payload, shared=0))


def _ended_by(signal_name: str) -> str:
    return (f"was ended by {signal_name}, sent to its agent by the engine "
            "(a cancelled SLURM job or step, a Ray actor that was killed)")


class _Agent:
    def __init__(self, conn: Connection, parent: int):
        self.conn = conn
        # A signal handler writes a byte here (``wake``): the relay's wait ends and sees its flag at once.
        self._wake, self._wake_w = os.pipe()
        for fd in (self._wake, self._wake_w):
            os.set_blocking(fd, False)
        self._parent = parent  # srun's step daemon, or the Ray actor
        self._folder = tempfile.TemporaryDirectory(prefix="nblaunch-modules-")  # the notebook's modules, if sent
        self.pool = None
        self.ending: Optional[str] = None  # why SLURM (or a signal) ends this node
        self.preempting: Optional[str] = None  # a preemption signal came (its name): the kernel tells every node
        self._told = False
        self._sampler = None
        self._pending: list = []  # what the ranks sent, not relayed yet (RELAY_TICK_S)
        self.beats = None  # the heartbeats with the kernel (wire.beats.Beats)
        self.cut_off: Optional[str] = None  # why this node is on its own now: the kernel is silent, or dropped it
        self._left = threading.Event()  # run() is over: its ranks are stopped

    def lose_kernel(self, why: str) -> None:
        """From the heartbeat thread: the kernel stopped answering, or dropped this node. The
        ranks are stopped, by the relay or, if it is stuck, here."""
        if self.cut_off is not None:
            return
        self.cut_off = why
        print(f"nblaunch agent: {why}: ending this node's ranks", flush=True)
        self.wake()
        timer = threading.Timer(CUT_OFF_EXIT_S, self._kill_all)
        timer.daemon = True
        timer.start()

    def _kill_all(self) -> None:
        if self._left.is_set():
            return
        from ..system.resources import tree_of

        for pid in reversed(tree_of(os.getpid())[1:]):  # the zygote, the ranks, what they started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(1)

    def orphaned(self) -> bool:
        """The process that started this agent is gone, or going (exiting: Linux
        closes a dying process's files, which tells Ray's raylet it died, before it
        hands its children on). A SIGTERM then is its loss being cleaned up (the
        raylet ends a dead actor's children so), not a preemption notice: the
        node is lost."""
        from ..system.pidfds import exiting

        return os.getppid() != self._parent or exiting(self._parent)

    def run(self) -> int:
        from .local_pool import LocalPool

        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return 0
            if isinstance(message, msg.Setup):
                self.pool = LocalPool(*self._plan(message))
                break
            if isinstance(message, msg.Close):
                return 0
        try:
            self.pool.start()
            self._send(msg.RanksStarted(self.pool.log_dir.as_posix()))
            return self._relay()
        finally:
            self.pool.close()
            self._folder.cleanup()
            self._left.set()

    def _plan(self, setup: "msg.Setup") -> tuple:
        from ..wire import modules
        from .plan import plan_ranks
        from ..system.resources import Sampler, gpu_devices

        config = setup.config
        # Before the plan: it records the environment the ranks get (PYTHONPATH included).
        installed = modules.install(setup.modules, Path(self._folder.name))
        if installed:
            print(f"nblaunch agent: installed the notebook's modules {', '.join(installed)} for this node's ranks",
                  flush=True)
        # This node alone: its place in the job comes with the setup (num_nodes was the engine's).
        node_config = dataclasses.replace(config, cluster=None, num_nodes=1, min_nodes=None, master_addr=setup.node_addr,
                                          backend=setup.backend or config.backend)
        plan = plan_ranks(node_config, live=setup.live)
        self._sampler = Sampler(gpu_devices(list(range(config.num_processes))))
        return plan, Placed(setup.placement), setup.job, setup.attempt

    def _relay(self) -> int:
        import time

        from .pipes import routine

        pool, conn = self.pool, self.conn
        also = [conn, self._wake]
        sent_at = 0.0
        while True:
            wait = RELAY_TICK_S - (time.monotonic() - sent_at) if self._pending else IDLE_WAKE_S
            items = pool.poll(max(0.0, wait), also=also)
            self._woken()
            if self.cut_off is not None:
                pool.stop(2.0)
                return 0
            if self.ending is not None:
                self._send(msg.Bye(self.ending))
                pool.stop(2.0)
                self._pending += items + pool.poll(0) + pool.drain()
                self._flush()
                return 0
            self._pending += items
            if any(not routine(i) for i in items) or time.monotonic() - sent_at >= RELAY_TICK_S:
                self._flush()
                sent_at = time.monotonic()
            if self.preempting is not None and not self._told and self.orphaned():
                self.ending = _ended_by(self.preempting)
                continue
            if self.preempting is not None and not self._told:
                self._told = True
                pool.preempt(f"{self.preempting} to this node's agent")  # this node's ranks at once
                self._flush()  # what came before the notice, first
                self._send(msg.PreemptNotice(self.preempting))
            usage = self._sampler.sample(pool.running_pids())
            if usage:
                self._send(msg.Usage(usage))
            while conn.poll(0):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    pool.stop(2.0)  # the kernel is gone
                    return 0
                self.beats.heard("kernel")
                if self._apply(message):
                    return 0

    def _woken(self) -> None:
        """Empty the wake-up pipe (what the signal set is in ``ending`` or ``preempting``)."""
        try:
            while os.read(self._wake, 512):
                pass
        except BlockingIOError:
            pass

    def wake(self) -> None:
        """From a signal handler: end the relay's wait now."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full: a wake is pending anyway
            pass

    def _apply(self, message) -> bool:
        """One message from the kernel (:mod:`nblaunch.wire.agent_messages`); True when it says to leave."""
        from ..wire.channel import RELEASE

        pool = self.pool
        if isinstance(message, msg.Deliver):
            if message.message != RELEASE:  # results were released here, once fetched
                pool.send(message.local, message.message)
        elif isinstance(message, msg.SignalRanks):
            pool.signal(message.sig, message.ranks)
        elif isinstance(message, msg.Ask):
            self._send(msg.Reply(message.rid, self._answer(message)))
        elif isinstance(message, msg.Preempt):
            pool.preempt(message.why)
        elif isinstance(message, (msg.Close, msg.Dropped)):
            return True
        elif isinstance(message, msg.Heartbeat):
            pass  # on the heartbeat link (wire.beats); any message counts as one
        return False

    def _answer(self, ask: "msg.Ask"):
        if ask.what == "drain":  # every rank's last output goes before the reply
            self._pending += self.pool.drain()
            self._flush()
            return None
        return self.pool.stacks(ask.ranks) if ask.what == "stacks" else self.pool.collectives(ask.ranks)

    def _flush(self) -> None:
        """What the node's ranks sent since the last flush, as one message."""
        from .pipes import coalesce

        if self._pending:
            items, self._pending = coalesce(self._pending), []
            self._send(msg.Relayed([relayable(i, self.pool) for i in items]))

    def _send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):
            pass  # the kernel is gone: the next read says so


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nblaunch.engines.agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--node-var", default="", help="the variable holding this node's index")
    parser.add_argument("--node-base", type=int, default=0, help="added to it: the nodes of the steps before")
    parser.add_argument("--name-var", default="", help="the variable holding this node's name")
    opts = parser.parse_args(argv)
    parent = os.getppid()  # before the imports below: it may die meanwhile
    # What this process imports stays for its life, so a collection during
    # the imports finds nothing to free: without those collections an agent's
    # start takes 0.25-0.45 s less CPU, on every node's way to its first step.
    gc.disable()
    from ..wire import link
    from ..system.network import route_address

    secret = bytes.fromhex(os.environ.pop(link.SECRET_ENV, ""))
    address = os.environ.pop(link.ADDRESS_ENV, "")
    if not secret or not address:
        parser.error(f"{link.SECRET_ENV} and {link.ADDRESS_ENV} must be set (the kernel sets them)")
    host, port = address.rsplit(":", 1)
    lost_after = _lost_after()
    agent: Optional[_Agent] = None

    def end(signum, frame) -> None:
        if agent is not None and agent.ending is None:
            agent.ending = _ended_by(signal.Signals(signum).name)
            agent.wake()

    def preempt(signum, frame) -> None:
        if agent is not None and (agent.pool is None or agent.orphaned()):  # no ranks: nothing to save
            end(signum, frame)
        elif agent is not None and agent.preempting is None:
            agent.preempting = signal.Signals(signum).name
            agent.wake()

    # SIGTERM is never nblaunch's: the kernel ends an agent over the link, or
    # with SIGKILL (srun's double SIGINT, a Ray actor's kill). It is what SLURM
    # sends every process of a step on preemption, scancel and the time limit,
    # SIGKILL following after KillWait: a notice, as scancel --signal=USR1 and
    # --signal=USR1@60 are; every rank of the job is told.
    signal.signal(signal.SIGTERM, preempt)
    signal.signal(signal.SIGINT, end)
    signal.signal(signal.SIGUSR1, preempt)
    # A Ray worker starts its children with SIGINT blocked; ranks inherit the
    # mask, and a blocked SIGINT is the stop button doing nothing.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1})
    # What every rank needs, imported once here before the ranks are forked
    # (a fresh process: no OpenMP pool, no CUDA), while the other nodes start.
    import cloudpickle  # noqa: F401
    import torch
    import torch.distributed

    from ..rank import worker  # noqa: F401

    gc.freeze()  # never visited again here, nor in the ranks forked from this process (see rank.worker)
    gc.enable()
    conn = link.connect((host.strip("[]"), int(port)), secret)
    agent = _Agent(conn, parent)
    node = opts.node_base + int(os.environ.get(opts.node_var, "0") or 0)
    conn.send(msg.Hello(node=node, name=os.environ.get(opts.name_var) or socket.gethostname(),
                        addr=route_address(host.strip("[]"), int(port)), pid=os.getpid(),
                        gpus=torch.cuda.device_count(), nccl=torch.distributed.is_nccl_available()))
    agent.beats = _beat(agent, link.connect((host.strip("[]"), int(port)), secret), node, lost_after)
    try:
        return agent.run()
    finally:
        agent.beats.stop()
        conn.close()


def _lost_after() -> float:
    """``NBLAUNCH_NODE_LOST_AFTER`` as the kernel set it for its agents (the launch's ``node_lost_after``)."""
    from ..config import lost_after

    return lost_after()


def _beat(agent: _Agent, beat_link: Connection, node: int, lost_after: float):
    """The heartbeats with the kernel, on their own link, in their own thread."""
    from ..wire.beats import Beats

    def said(key, message) -> None:
        if message is None:
            agent.lose_kernel("the kernel closed the heartbeat link")
        elif isinstance(message, msg.Dropped):
            agent.lose_kernel(f"the kernel dropped this node ({message.why})")

    beat_link.send(msg.BeatLink(node))
    beats = Beats(lost_after, on_silent=lambda key, s: agent.lose_kernel(
        f"the kernel stopped answering: no heartbeat for {s:.0f} s"), on_word=said)
    beats.add("kernel", beat_link)
    return beats


if __name__ == "__main__":
    sys.exit(main())
