"""The Spark engine: ranks on the executors of the notebook's Spark application.

Spark starts the processes: one barrier stage (``rdd.barrier().mapPartitions``)
of one task per node, each task running an nblaunch agent
(:mod:`nblaunch.engines.agent`) as its child (:mod:`.spark_task`), and the
agent starts that node's ranks and talks to the kernel over the
authenticated link, exactly as under SLURM and Ray. What Spark does
differently, and what is done about it:

* The stage runs from a thread of the kernel, under a job group of its own:
  when the agents do not leave when told, the group is cancelled (Spark
  kills the tasks' workers; each agent, whose parent died, stops its ranks).
  The verdict does not wait for Spark to end the stage once the agents have
  left (its bookkeeping takes seconds on a busy driver): the stage is ended
  apart, and the next stage of the session starts once it has.
* A failed task makes Spark abort and rerun the whole barrier stage: the
  task never fails (its agent's exit and output are its result), and a rerun
  starts no agent. Restarts are nblaunch's (``max_restarts``, ``min_nodes``).
* An executor with several cores runs as many tasks at once, and two tasks
  of the stage could share one. The stage asks for every core (and each
  task resource) of an executor per task, a stage-level task resource
  profile: one task, one agent, per executor.
* A barrier stage of more tasks than the executors can run at once waits
  forever: refused before it starts. So is dynamic allocation, which barrier
  mode does not support.
* Executors do not inherit the kernel's environment: it is sent with the task.
* An executor that is lost takes its worker's process group (the agent, and
  through their lifelines the ranks) with it: a lost node. An executor being
  decommissioned (Spark's graceful decommission) is a preemption notice to
  every rank, as SLURM's SIGTERM is (:mod:`nblaunch.watch.preempt`).
* After a lost executor (``min_nodes``), an executor the agents are not on
  (Spark's replacement for the lost one, one the cluster manager added) is
  taken once it has stayed registered for ``node_back_after``, up to
  ``max_nodes``: the next stage has a task more (:mod:`.regrow`).
"""
from __future__ import annotations

import functools
import math
import os
import re
import sys
import threading
import time
import uuid
from typing import Callable, Optional

from . import spark_task
from .agent_engine import AgentEngine, AgentStep
from .pool import TEARDOWN_WAIT_S
from ..clusters import Spark
from ..errors import LaunchError

__all__ = ["Spark", "SparkEngine", "spark_session", "in_local_mode"]

EXECUTORS_WAIT_S = 120.0  # a fresh application's executors registering
EXECUTORS_QUIET_S = 1.0  # executors this quick (the usual case) are not worth a notice
DECOMMISSION_POLL_S = 1.0  # how often the kernel asks whether one of the executors is being decommissioned
EXECUTORS_POLL_S = 1.0  # how often the kernel asks which executors there are (spare ones to grow onto)
CANCEL_WAIT_S = 30.0  # a cancelled job group's tasks killed
# Application id -> the last stage of agents started in it from this kernel,
# which may still be ending when the next launch (or a restart) starts one.
_LAST_STAGE: dict = {}
_PROFILES: dict = {}  # (application id, task resources) -> its resource profile, registered once
# Kernel variables an executor must not get: the kernel's own gateway to its JVM.
_KERNEL_ONLY = ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "PYSPARK_PIN_THREAD", "_PYSPARK_DRIVER_CONN_INFO_PATH")


def spark_session(spec: Spark):
    """The session ``spec`` names, else the notebook's active one; a one-line error without."""
    if spec.session is not None:
        return spec.session
    found = None
    if "pyspark" in sys.modules:  # importing nblaunch never imports pyspark: without it there is no session
        from pyspark.sql import SparkSession

        found = SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None)
    if found is None:
        raise LaunchError("cluster='spark' runs the ranks on the executors of this notebook's SparkSession, and "
                          "there is none: make one first (spark = SparkSession.builder.getOrCreate()), or give "
                          "cluster=nblaunch.Spark(session=spark)")
    return found


def in_local_mode(session) -> bool:
    """The session runs in one JVM (``local``/``local[*]``): no executors of their own."""
    master = _context(session).master
    return master.startswith("local") and not master.startswith("local-cluster")


def _context(session):
    try:
        return session.sparkContext
    except Exception as exc:  # noqa: BLE001 - Spark Connect has none
        raise LaunchError(f"cluster='spark' needs a classic SparkSession with a SparkContext; this one has none "
                          f"({type(exc).__name__}: a Spark Connect session cannot run barrier tasks)") from None


def _executor_of(node_name: str) -> Optional[str]:
    """The executor id in an agent's name (``host (executor 3)``, :mod:`.spark_task`)."""
    found = re.search(r"\(executor ([^)]+)\)$", node_name)
    return found.group(1) if found else None


def _expected_executors(sc) -> Optional[int]:
    """How many executors the application was given (``spark.executor.instances``,
    or a ``local-cluster[N,...]`` master's N); None where Spark does not say."""
    found = re.match(r"local-cluster\[\s*(\d+)", sc.master or "")
    count = sc.getConf().get("spark.executor.instances") or (found.group(1) if found else None)
    return int(count) if count and str(count).isdigit() else None


def _executors(sc) -> list[str]:
    """The ids of the application's executors now."""
    ids = sc._jsc.sc().getExecutorIds().mkString(",")
    return [i for i in ids.split(",") if i]


def _one_task_each(sc):
    """A task resource profile under which an executor runs one task at a
    time (a task asks for what the executor's tasks have together), where
    it would run several; None where it runs one anyway, or where Spark
    cannot schedule a stage by a profile. Executors are taken to be alike."""
    j = sc._jsc.sc()
    ids = _executors(sc)
    per = int(j.maxNumConcurrentTasks(j.resourceProfileManager().defaultResourceProfile())) // max(len(ids), 1)
    if per <= 1:
        return None
    conf = dict(sc.getConf().getAll())
    amounts = {"cpus": float(conf.get("spark.task.cpus", "1"))}
    amounts.update({k.split(".")[3]: float(v) for k, v in conf.items()
                    if k.startswith("spark.task.resource.") and k.endswith(".amount")})
    amounts = {k: a * per if a * per <= 1 else float(math.floor(a * per)) for k, a in amounts.items()}
    key = (sc.applicationId, tuple(sorted(amounts.items())))
    if key not in _PROFILES:
        from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

        asks = TaskResourceRequests().cpus(amounts.pop("cpus"))
        for name, amount in amounts.items():
            asks.resource(name, amount)
        profile = ResourceProfileBuilder().require(asks).build
        try:
            j.resourceProfileManager().addResourceProfile(profile._java_resource_profile)
        except Exception:  # noqa: BLE001 - a master without stage-level scheduling: Spark's own placement
            profile = None
        _PROFILES[key] = profile
    return _PROFILES[key]


class SparkEngine(AgentEngine):
    """The executors of one Spark application, and a barrier stage of agents on them."""

    name = "spark"

    def __init__(self, config, live: bool = False):
        super().__init__(config, live)
        self.spec: Spark = config.cluster
        self.sc = _context(spark_session(self.spec))
        conf = self.sc.getConf()
        if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
            raise LaunchError("cluster='spark' runs a barrier stage, which Spark does not run with dynamic "
                              "allocation: start the session with spark.dynamicAllocation.enabled=false")
        self._profile = None  # one task per executor (_one_task_each), once executors are there
        self._asked = self.spec.nodes or (config.num_nodes if config.num_nodes > 1 else None)
        # One node per executor the application was given (a fresh one's are waited for, not only the
        # first to register); 0 where Spark does not say: one per executor there, counted in allocate.
        self._want = self._asked or _expected_executors(self.sc) or 0
        self._slots = self._capacity()
        if self._asked and self._asked > self._slots:
            raise LaunchError(self._too_many(self._asked))
        self._in_use: set = set()  # the executors the agents are on
        self._lost: set = set()  # executors lost: never back (Spark's replacement has an id of its own)
        self._seen, self._seen_at = [], -EXECUTORS_POLL_S

    def _capacity(self) -> int:
        """How many tasks the application's executors run at once (what a barrier stage may have)."""
        j = self.sc._jsc.sc()
        self._profile = _one_task_each(self.sc) if _executors(self.sc) else None
        rp = self._profile._java_resource_profile if self._profile is not None else None
        return int(j.maxNumConcurrentTasks(rp or j.resourceProfileManager().defaultResourceProfile()))

    def _too_many(self, nodes: int) -> str:
        return (f"{nodes} nodes were asked for, and the Spark application's executors run {self._slots} tasks at "
                f"once: a barrier stage of {nodes} tasks would wait forever. Ask for at most {self._slots} "
                "(cluster=nblaunch.Spark(nodes=...)), or give the application more executors")

    @property
    def num_nodes(self) -> int:
        return self._want or len(_executors(self.sc)) or 1

    @property
    def label(self) -> str:
        return f"Spark application {self.sc.applicationId} ({self.sc.master})"

    @property
    def reach(self) -> str:
        return self.sc.getConf().get("spark.driver.host") or "127.0.0.1"  # what the executors reach the driver at

    def without(self, names: list[str]) -> None:
        self._want = self.num_nodes - len(names)
        gone = {_executor_of(n) for n in names} - {None}
        self._in_use -= gone
        self._lost |= gone

    def spare(self) -> list[str]:
        """Executors (ids) the agents are not on, never lost."""
        if time.monotonic() - self._seen_at >= EXECUTORS_POLL_S:
            self._seen, self._seen_at = _executors(self.sc), time.monotonic()
        return [e for e in self._seen if e not in self._in_use and e not in self._lost]

    def usable(self, name: str) -> bool:
        return name in _executors(self.sc)

    def with_nodes(self, names: list[str]) -> None:
        self._want = self.num_nodes + len(names)  # the next stage has a task more for each

    def node_label(self, name: str) -> str:
        return f"executor {name}"

    def place(self, pool, view) -> None:
        super().place(pool, view)
        self._in_use = {e for e in (_executor_of(pool.host(r) or "") for r in range(pool.size)) if e}

    def allocate(self, notice: Callable[[str], None], tick: Callable[[], None]) -> None:
        """The executors registered (a fresh application's come a few seconds after its session)."""
        t0, said = time.monotonic(), False
        need = self._want or 1
        while not _executors(self.sc) or self._capacity() < need:
            if not said and time.monotonic() - t0 > EXECUTORS_QUIET_S:
                notice(f"waiting for the Spark application's executors ({self.sc.master})")
                said = True
            if time.monotonic() - t0 > EXECUTORS_WAIT_S:
                raise LaunchError(f"the Spark application ({self.sc.master}) has no executors free for "
                                  f"{need} tasks after {EXECUTORS_WAIT_S:.0f} s")
            tick()
            time.sleep(0.2)
        self._slots = self._capacity()
        self._want = self._want or len(_executors(self.sc))
        if self._want > self._slots:
            raise LaunchError(self._too_many(self._want))

    def start_agents(self, env: dict, log_path: str) -> "_Stage":
        from .slurm import without_slurm_vars

        environ = {k: v for k, v in {**without_slurm_vars(os.environ), **env}.items() if k not in _KERNEL_ONLY}
        last = _LAST_STAGE.get(self.sc.applicationId)
        if last is not None:  # its tasks hold the executors' slots until it has ended
            last.ended(CANCEL_WAIT_S + TEARDOWN_WAIT_S)
        stage = _LAST_STAGE[self.sc.applicationId] = _Stage(self.sc, self._want, environ, self._profile)
        return stage

    def close(self) -> None:
        super().close()  # the probes; the session is the notebook's: it stays


class _Stage(AgentStep):
    """The barrier stage of agents, run from a thread of the kernel under a job group of its own."""

    what = "Spark barrier stage"

    def __init__(self, sc, nodes: int, environ: dict, profile=None):
        from pyspark import cloudpickle
        from pyspark.accumulators import AccumulatorParam

        class _Ends(AccumulatorParam):  # the tasks' (node, code, output), each as its task ends
            def zero(self, value):
                return []

            def addInPlace(self, a, b):
                return a + b

        cloudpickle.register_pickle_by_value(spark_task)  # the executors need not import nblaunch for the task
        self._sc, self._nodes, self._profile = sc, nodes, profile
        self._group = f"nblaunch-{uuid.uuid4().hex[:12]}"
        self._ends = sc.accumulator([], _Ends())
        self._executors = set(_executors(sc))
        self._failed: Optional[str] = None
        self._decommission_check = 0.0
        self._ender: Optional[threading.Thread] = None  # ends the stage once the agents have left
        task = functools.partial(spark_task.run_agent, environ, os.getcwd(), sys.executable, self._ends)
        self._thread = threading.Thread(target=self._run, args=(task,), name="nblaunch-spark-stage", daemon=True)
        self._thread.start()

    def _run(self, task) -> None:
        sc = self._sc
        try:
            sc.setJobGroup(self._group, f"nblaunch: {self._nodes} node agents", interruptOnCancel=True)
            stage = sc.parallelize(range(self._nodes), self._nodes).barrier().mapPartitions(task)
            (stage.withResources(self._profile) if self._profile is not None else stage).collect()
        except BaseException as exc:  # noqa: BLE001 - a cancelled or failed job: the news
            self._failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"

    def _found(self) -> list:
        return [e for e in self._ends.value if e[1] is not None]

    def poll(self) -> Optional[int]:
        """An exit code once any agent has ended (the launch cannot go on without it)."""
        codes = [code for _, code, _ in self._found()]
        if codes:
            return next((c for c in codes if c != 0), codes[0])
        return -1 if not self._thread.is_alive() else None

    def output(self) -> str:
        found = [text for _, _, text in sorted(self._found())]
        return "\n".join(found + ([f"the Spark job: {self._failed}"] if self._failed else []))

    def news(self) -> str:
        gone = sorted(self._executors - set(_executors(self._sc)))
        if gone:
            return f"was lost: Spark lost executor {', '.join(gone)}"
        return f"was lost: {self._failed}" if self._failed else ""

    def preempting(self) -> Optional[tuple]:
        """One of the application's executors is being decommissioned (asked once a second)."""
        now = time.monotonic()
        if now < self._decommission_check:
            return None
        self._decommission_check = now + DECOMMISSION_POLL_S
        try:
            scheduler = self._sc._jsc.sc().taskScheduler()
            leaving = [e for e in self._executors if scheduler.getExecutorDecommissionState(e).isDefined()]
        except Exception:  # noqa: BLE001 - the JVM busy or gone: asked again next time
            return None
        return ("a decommission", f"Spark executor {leaving[0]}") if leaving else None

    def end(self, timeout: float) -> None:
        """Called once the agents were told to leave and waited for: the
        stage is ended from a thread of its own (its tasks given ``timeout``
        to return, then the job group cancelled), and this returns at once."""
        if self._ender is None:
            self._ender = threading.Thread(target=self._finish, args=(timeout,), name="nblaunch-spark-end", daemon=True)
            self._ender.start()

    def _finish(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            try:
                self._sc.cancelJobGroup(self._group)
            except Exception:  # noqa: BLE001 - the session was stopped meanwhile: its jobs with it
                return
            self._thread.join(CANCEL_WAIT_S)

    def ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the Spark job to be over; True if it is."""
        self.end(TEARDOWN_WAIT_S)
        self._ender.join(timeout)
        return not self._thread.is_alive()

