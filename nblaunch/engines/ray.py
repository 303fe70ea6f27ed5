"""The Ray engine: ranks on the nodes of the Ray cluster the notebook is connected to.

Ray starts the processes: one actor per node, placed one per node by a
placement group with ``STRICT_SPREAD``, runs an nblaunch agent
(:mod:`nblaunch.engines.agent`) as its child, and the agent starts that node's ranks
and talks to the kernel over the authenticated channel, exactly as under
SLURM. What Ray does differently, and what is done about it:

* Ray workers do not inherit the driver's environment: the kernel's is sent
  with the actor call and given to the agent.
* A Ray worker's threads run with SIGINT blocked, and children inherit the
  mask: the agent unblocks it before it starts any rank (``agent.main``), or
  the stop button would do nothing.
* An actor that dies, or a node that leaves, closes its agent's connection:
  a ``RankFailure`` naming the node. The actors are owned by the kernel's
  Ray driver, so a killed kernel takes them (and, through the agents, the
  ranks) with it; ``close()`` kills them and removes the placement group.
* A node being drained (Ray's autoscaler before a spot node is reclaimed,
  ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) is a preemption
  notice to every rank, as SLURM's SIGTERM is (:mod:`nblaunch.watch.preempt`).
* After a lost node (``min_nodes``), an alive node the agents are not on (one
  that rejoined, a new one the autoscaler added) with room for a node's
  ranks is taken once it has stayed alive for ``node_back_after``
  (:mod:`.regrow`), up to ``max_nodes``: the next placement group has a
  bundle more, as Ray Train's elastic scaling grows when resources return.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

from .agent_engine import AgentEngine, AgentStep
from ..clusters import Ray
from ..errors import LaunchError

__all__ = ["Ray", "RayEngine"]

PLACEMENT_WAIT_S = 120.0
PLACEMENT_QUIET_S = 1.0  # a placement this quick (the usual case) is not worth a notice
DRAIN_POLL_S = 1.0  # how often the kernel asks Ray whether one of the launch's nodes is being drained
NODES_POLL_S = 1.0  # how often the kernel asks Ray's GCS which nodes are alive (spare nodes to grow onto)


def _ray():
    try:
        import ray
    except ImportError:
        raise LaunchError("cluster='ray' needs Ray in this environment (and on every node): "
                          "pip install 'ray>=2.9'") from None
    return ray


def _check_answers(address: str) -> None:
    """A cluster address that nothing answers at is an error now: ``ray.init``
    would retry for minutes."""
    if address == "auto" or "://" in address:
        return
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        raise LaunchError(f"no Ray cluster answers at {address} ({exc}); start one (ray start --head) or give "
                          "the address of its head node") from None


class RayEngine(AgentEngine):
    """The alive nodes of the connected Ray cluster, and one agent actor on each."""

    name = "ray"

    def __init__(self, config, live: bool = False):
        super().__init__(config, live)
        spec: Ray = config.cluster
        num_nodes, num_processes = (config.num_nodes if config.num_nodes > 1 else None), config.num_processes
        ray = _ray()
        self.spec = spec
        if not ray.is_initialized():
            address = spec.address or os.environ.get("RAY_ADDRESS") or "auto"
            _check_answers(address)
            # Ranks' output reaches the kernel through the agents: Ray's own
            # log forwarding would print it a second time, deduplicated.
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as exc:
                raise LaunchError(f"cluster='ray' found no Ray cluster to connect to ({exc}). Start one "
                                  "(ray start --head), or connect first: ray.init(address=...), or give "
                                  "cluster=nblaunch.Ray(address='host:port').") from None
        alive = [n for n in ray.nodes() if n.get("Alive")]
        want = spec.nodes or num_nodes or len(alive)
        if want > len(alive):
            raise LaunchError(f"{want} nodes were asked for, and the Ray cluster has {len(alive)} alive")
        self._want = want
        self._per_node = {k: v * num_processes for k, v in spec.resources_per_rank.items() if v}
        self._gcs = ray.get_runtime_context().gcs_address
        self._pg = None
        self._in_use: set = set()  # node ids (hex) of the agents' bundles
        self._lost: set = set()  # node ids of nodes lost: never taken back
        self._alive: dict = {}  # node id -> host name: alive nodes with room for a node's ranks
        self._alive_at = -NODES_POLL_S

    @property
    def num_nodes(self) -> int:
        return self._want

    @property
    def label(self) -> str:
        return f"Ray cluster at {self._gcs}"

    def without(self, names: list[str]) -> None:
        self._want -= len(names)  # the next placement group has that many fewer bundles
        # A Ray node lost is never taken back: a raylet started again is a node with a new id, and
        # the GCS may still count a frozen one alive for a while.
        gone = {i for i in self._in_use if any(n.endswith(":" + i[:6]) for n in names)}
        self._in_use -= gone
        self._lost |= gone

    def spare(self) -> list[str]:
        """Alive nodes (ids) the agents are not on, each with room for a node's ranks."""
        self._refresh()
        return [i for i in self._alive if i not in self._in_use and i not in self._lost]

    def usable(self, name: str) -> bool:
        """Alive now, as Ray's GCS says (a probe: asked afresh)."""
        self._refresh(now=True)
        return name in self._alive

    def with_nodes(self, names: list[str]) -> None:
        self._want += len(names)  # the next placement group spreads over them too (STRICT_SPREAD)

    def node_label(self, name: str) -> str:
        return f"{self._alive[name]}:{name[:6]}" if name in self._alive else name[:6]

    def _refresh(self, now: bool = False) -> None:
        if not now and time.monotonic() - self._alive_at < NODES_POLL_S:
            return
        try:
            nodes = _ray().nodes()
        except Exception:  # noqa: BLE001 - the GCS did not answer: asked again next time
            return
        self._alive_at = time.monotonic()
        self._alive = {n["NodeID"]: n.get("NodeManagerHostname", "") for n in nodes if n.get("Alive")
                       and all(n.get("Resources", {}).get(k, 0) >= v for k, v in self._per_node.items())}

    @property
    def reach(self) -> str:
        return self._gcs.rsplit(":", 1)[0]

    def allocate(self, notice: Callable[[str], None], tick: Callable[[], None]) -> None:
        """One bundle of the node's ranks' resources on each of ``nodes`` nodes (STRICT_SPREAD)."""
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        self._remove_group()  # a restarted generation's agents get a new group
        self._pg = placement_group([dict(self._per_node) for _ in range(self._want)], strategy="STRICT_SPREAD")
        t0, said = time.monotonic(), False
        deadline = t0 + PLACEMENT_WAIT_S
        ready = self._pg.ready()
        try:
            while not ray.wait([ready], timeout=0.1)[0]:
                if not said and time.monotonic() - t0 > PLACEMENT_QUIET_S:
                    notice(f"waiting for Ray to place {self._want} agents, one per node, each with {self._per_node}")
                    said = True
                if time.monotonic() > deadline:
                    raise LaunchError(f"Ray could not place {self._want} agents on distinct nodes with "
                                      f"{self._per_node} each within {PLACEMENT_WAIT_S:.0f} s: "
                                      f"{ray.available_resources()} available")
                tick()
        except BaseException:
            remove_placement_group(self._pg)
            self._pg = None
            raise

    def start_agents(self, env: dict, log_path: str) -> "_Actors":
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .slurm import without_slurm_vars

        environ = {**without_slurm_vars(os.environ), **env}
        actor_cls = _ray().remote(num_cpus=0, max_concurrency=2)(_AgentActor)
        actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._pg, placement_group_bundle_index=i)).remote() for i in range(self._want)]
        runs = [a.run.remote(environ, i, os.getcwd()) for i, a in enumerate(actors)]
        nodes = _bundle_nodes(self._pg)
        self._in_use = set(nodes)
        return _Actors(actors, runs, nodes)

    def close(self) -> None:
        """Stop probing; remove the placement group."""
        super().close()
        self._remove_group()

    def _remove_group(self) -> None:
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone already
                pass
            self._pg = None


def _bundle_nodes(pg) -> list:
    """The Ray node id (hex) of each bundle of a ready placement group."""
    from ray.util import placement_group_table

    where = placement_group_table(pg).get("bundles_to_node_id", {})
    return [where.get(i, "") for i in range(len(where))]


def _draining() -> dict:
    """Ray's nodes being drained, ``node id (hex) -> deadline (ms since the
    epoch, 0: none)``: what Ray's autoscaler asks on a spot reclaim, and
    ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``. Ray has no
    public call for it; Ray Train's own preemption watcher reads this one."""
    from ray._private import state

    return state.state.get_draining_nodes() or {}


class _AgentActor:
    """Inside Ray, on one node: runs that node's agent and waits for it."""

    def __init__(self):
        self._proc = None

    def run(self, env: dict, node: int, cwd: str) -> tuple:
        import socket
        import subprocess

        import ray

        ctx = ray.get_runtime_context()
        env = {**env, "NBLAUNCH_NODE": str(node),
               "NBLAUNCH_NODE_NAME": f"{socket.gethostname()}:{ctx.get_node_id()[:6]}"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "nblaunch.engines.agent", "--node-var", "NBLAUNCH_NODE", "--name-var", "NBLAUNCH_NODE_NAME"],
            env=env, cwd=cwd if os.path.isdir(cwd) else None, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = self._proc.stdout.read()
        return self._proc.wait(), out[-20000:].decode(errors="replace")

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


class _Actors(AgentStep):
    """The agent actors, as the rank pool sees them."""

    what = "Ray actors"

    def __init__(self, actors: list, runs: list, nodes: list):
        self._actors, self._runs, self._nodes = actors, runs, nodes
        self._done: dict = {}
        self._drain_check = 0.0

    def preempting(self) -> Optional[tuple]:
        """One of the agents' nodes is being drained (asked once a second)."""
        now = time.monotonic()
        if now < self._drain_check:
            return None
        self._drain_check = now + DRAIN_POLL_S
        try:
            draining = _draining()
        except Exception:  # noqa: BLE001 - a GCS hiccup: asked again next time
            return None
        for node in self._nodes:
            if node in draining:
                deadline = draining[node] / 1000 - time.time() if draining[node] else None
                left = f", {deadline:.0f} s before it is taken" if deadline is not None else ""
                return "a drain", f"Ray node {node[:6]}{left}"
        return None

    def _collect(self, timeout: float = 0.0) -> None:
        ray = _ray()
        pending = [r for r in self._runs if r not in self._done]
        if not pending:
            return
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout)
        for ref in ready:
            try:
                self._done[ref] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - an actor that died: its error is the news
                self._done[ref] = (-1, f"{type(exc).__name__}: {exc}")

    def poll(self) -> Optional[int]:
        """An exit code once any agent has ended (the launch cannot go on without it)."""
        self._collect()
        codes = [code for code, _ in self._done.values()]
        return next((c for c in codes if c != 0), codes[0]) if codes else None

    def output(self) -> str:
        self._collect()
        return "\n".join(text for _, text in self._done.values())

    def news(self) -> str:
        self._collect(1.0)
        died = [text for code, text in self._done.values() if code == -1]
        return f"was lost: its Ray actor died ({died[0].splitlines()[0][:300]})" if died else ""

    def end(self, timeout: float) -> None:
        ray = _ray()
        self._collect(timeout)
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
