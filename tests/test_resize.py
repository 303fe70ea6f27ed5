"""Growing back (issue 48), without a process: ``max_nodes`` refused before anything
starts, with a one-line reason; the rule that takes a node back only once it has
stayed usable (no flapping); the restart lines; a launch's generation ended by a
resize (the notice, the grace, the ranks stopped if they ignore it) and the
session calling ``fn`` again, larger, without counting it against ``max_restarts``."""
from __future__ import annotations

import io
import re
import signal
import time

import pytest

from nblaunch.config import LaunchConfig, check_max_nodes
from nblaunch.engines import engine_for
from nblaunch.engines import slurm as slurm_engine
from nblaunch.engines.base import Engine
from nblaunch.engines.pool import Exited
from nblaunch.engines.regrow import Steady
from nblaunch.engines.slurm_spares import Spares, minutes_left
from nblaunch.view import TextDisplay
from nblaunch.watch.launch import LaunchWatch
from nblaunch.watch.preempt import Catcher
from nblaunch.watch.resize import Resized
from nblaunch.watch.restarts import History
from test_core import FakePool, quiet_view, result, started

SLURM = {"cluster": "slurm", "max_restarts": 1}
ELASTIC = {"num_nodes": 3, "rdzv_endpoint": "127.0.0.1:29400", "max_restarts": 1}


# -- max_nodes: refused before anything starts ------------------------------------------

@pytest.mark.parametrize("kwargs, reason", [
    (ELASTIC | {"min_nodes": 3, "max_nodes": 2}, "max_nodes=2 is below min_nodes=3"),
    (ELASTIC | {"min_nodes": 2, "max_nodes": 4}, "max_nodes=4 is more than the c10d rendezvous of num_nodes can hold (3 nodes)"),
    (SLURM | {"max_nodes": 3}, "max_nodes is the size a run grows back to after it lost nodes: give min_nodes too"),
    (SLURM | {"min_nodes": 2, "max_nodes": 1}, "max_nodes=1 is below min_nodes=2"),
    (SLURM | {"min_nodes": 2, "max_nodes": 3, "node_back_after": -1}, "node_back_after must be a number of seconds >= 0"),
])
def test_a_bad_max_nodes_is_refused_with_a_one_line_reason(kwargs, reason):
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        LaunchConfig(1, **kwargs)
    assert reason in str(refused.value) and "\n" not in str(refused.value)
    assert time.perf_counter() - t0 < 0.05


def test_max_nodes_must_be_an_int():
    with pytest.raises(TypeError, match="max_nodes must be an int or None, got str"):
        LaunchConfig(1, **SLURM, min_nodes=2, max_nodes="3")


def test_the_rule_on_what_an_allocation_can_hold():
    check_max_nodes(None, 2, 3, "SLURM job 12")  # default: the nodes the launch starts with
    check_max_nodes(3, 2, 3, "SLURM job 12")
    with pytest.raises(ValueError, match=re.escape("max_nodes=4 is more than SLURM job 12 can hold (3 nodes)")):
        check_max_nodes(4, 2, 3, "SLURM job 12")


@pytest.fixture
def fake_slurm(monkeypatch):
    """SLURM's commands answering as an allocation of three running nodes would, no process run."""
    ran = []

    def run(args):
        ran.append(args)
        if args[1:3] == ["show", "job"]:
            return "JobId=12 JobState=RUNNING NodeList=n[1-3] NumCPUs=6 NumNodes=3\n"
        if args[1:3] == ["show", "hostnames"]:
            return "n1\nn2\nn3\n"
        return f"NodeName={args[-1]} NodeAddr=127.0.0.1\n"

    monkeypatch.setattr(slurm_engine, "_slurm_command", lambda name: name)
    monkeypatch.setattr(slurm_engine, "_run", run)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return ran


def test_inside_an_allocation_max_nodes_above_its_nodes_is_refused_before_any_agent(fake_slurm):
    config = LaunchConfig(1, cluster=slurm_engine.Slurm(job="12"), max_restarts=1, min_nodes=2, max_nodes=4)
    with pytest.raises(ValueError) as refused:
        engine_for(config)
    assert str(refused.value) == "max_nodes=4 is more than SLURM job 12 can hold (3 nodes)"
    assert not [a for a in fake_slurm if a[0] in ("srun", "salloc")]


def test_inside_an_allocation_max_nodes_may_reach_nodes_the_launch_does_not_start_on(fake_slurm):
    config = LaunchConfig(1, cluster=slurm_engine.Slurm(job="12", nodes=2), max_restarts=1, min_nodes=2, max_nodes=3)
    engine = engine_for(config)
    assert (engine.hosts, engine.max_nodes, engine.spare()) == (["n1", "n2"], 3, ["n3"])


def test_an_allocation_asked_for_holds_the_nodes_asked_for(fake_slurm):
    config = LaunchConfig(1, cluster=slurm_engine.Slurm(nodes=2), max_restarts=1, min_nodes=1, max_nodes=3)
    with pytest.raises(ValueError) as refused:
        engine_for(config)
    assert str(refused.value) == "max_nodes=3 is more than Slurm(nodes=2) can hold (2 nodes)"
    assert fake_slurm == []  # refused before SLURM was asked anything


# -- a node is back once it stayed usable -----------------------------------------------

def test_a_node_is_back_only_after_it_answered_every_probe_for_node_back_after():
    steady = Steady(10.0)
    for t in (0, 2, 4, 6, 8):
        steady.seen("n3", True, t)
    assert steady.back(9.9) == []
    assert steady.back(10.0) == ["n3"]


def test_a_node_that_flaps_is_never_taken_back():
    steady = Steady(10.0)
    for t in range(0, 60, 2):
        steady.seen("n3", t % 8 != 6, t)  # a bad probe every 8 s
        assert steady.back(t) == []
    steady.forget(["n3"])
    assert steady.back(100) == []


def test_a_node_taken_back_and_lost_again_starts_over():
    """A probe that answered as the node was taken back left a good run that, once the node
    was lost again, took it at once (the soak's launch ended on it)."""
    steady = Steady(10.0)
    for t in (0, 2, 4, 6, 8, 10):
        steady.seen("n3", True, t)
    steady.keep([])  # taken back: not a candidate while the run uses it
    steady.seen("n2", True, 11)
    assert steady.back(200) == ["n2"]  # n3, lost again at 200, is not back at once


def test_a_node_down_for_long_is_probed_less_often():
    steady = Steady(10.0)
    assert steady.due("n3", None, 0)
    steady.seen("n3", False, 0)
    assert not steady.due("n3", 0, 3) and steady.due("n3", 0, 5)
    steady.seen("n3", True, 5)
    assert steady.due("n3", 5, 7.5)


# -- the restart lines ------------------------------------------------------------------

def test_a_resize_is_a_restart_line_that_never_counts_against_max_restarts():
    from nblaunch.errors import RankFailure, WorkerError

    history = History(max_restarts=2)
    history.begin(3)
    lost = RankFailure(2, "node", time.time(), message="was lost: its agent connection closed", node=2, host="n3")
    history.record(WorkerError([lost]), {0: 40, 1: 40}, 2, 4)
    history.resized(["n3"], 3, 6)
    assert history.lines[1] == "restart 2 of 3: n3 back; 3 nodes, 6 ranks"
    assert re.fullmatch(r"restart 1 of 2: .*n3.* at step 40; 2 nodes, 4 ranks", history.lines[0]), history.lines[0]
    assert history.summary().startswith("finished after 2 restart(s): ")
    assert re.search(r"; nodes over time: [▁-█]{24} \(3 from 0:00, 2 from 0:00, 3 from 0:00\)$", history.summary())


def test_the_summary_draws_the_nodes_against_time_as_a_strip():
    from nblaunch.watch.restarts import size_strip

    # three nodes for 12 minutes, two for 6, three again for 6; a cell is 3 minutes
    assert size_strip([(0, 3), (720, 2), (1080, 3)], 1440, cells=8) == "████▆▆██"
    assert size_strip([(0, 4), (30, 1)], 60, cells=4) == "██▃▃"


# -- a generation ended by a resize ------------------------------------------------------

class ResizedPool(FakePool):
    """Ranks in their call until told; ``obey``: they then return (else they run on)."""

    def __init__(self, size, obey=True, answer="saved"):
        super().__init__(size, script=[[started(r) for r in range(size)]])
        self.obey, self.answer, self.why, self.notice = obey, answer, None, None

    @property
    def log_files(self) -> list:
        return []

    def preempt(self, why: str) -> None:
        self.why = why
        if self.obey:
            self._queued += [result(r, self.answer) for r in range(self.size)]
            self._queued += [Exited(r, 0) for r in range(self.size)]


def _back_after(polls: int, nodes=("n3",)):
    asked = []

    def back():
        asked.append(time.monotonic())
        return list(nodes) if len(asked) > polls else []
    return back


def test_the_ranks_get_the_notice_say_resize_and_their_results_are_dropped():
    pool = ResizedPool(2)
    view = quiet_view(2)
    watch = LaunchWatch(pool, view, 0, preemption=Catcher(5.0), nodes_back=_back_after(3))
    with pytest.raises(Resized) as resized:
        watch.run(pool.start)
    assert resized.value.nodes == ["n3"]
    assert pool.why == "resize: n3 is back"
    assert not pool.signals  # they returned within the grace: nothing stopped


def test_a_resize_the_ranks_ignore_stops_them_after_the_grace_and_the_run_goes_on():
    pool = ResizedPool(2, obey=False)
    shown = io.StringIO()
    view = TextDisplay(stream=shown)
    view.begin(2, "fork", "gloo", "/tmp/nblaunch-fake")
    t0 = time.monotonic()
    watch = LaunchWatch(pool, view, 0, preemption=Catcher(0.3), nodes_back=_back_after(0))
    with pytest.raises(Resized):
        watch.run(pool.start)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert {sig for _, sig in pool.signals} >= {signal.SIGTERM}
    view.close("resized")
    assert "n3 is back: resizing; the ranks have 0.3 s to save and return" in shown.getvalue()
    assert "grace of the resize is over; stopping the ranks (the run goes on)" in shown.getvalue()


class FakeEngine(Engine):
    """Generation 0 on two nodes, n3 back during it; the next on three."""

    method, backend, pg_timeout = "fake", "gloo", 60.0

    def __init__(self):
        self.nodes, self.pools = 2, []

    @property
    def world_size(self):
        return self.nodes

    @property
    def job_nodes(self):
        return self.nodes

    def new_pool(self, job, attempt):
        pool = ResizedPool(self.nodes, answer=f"generation {attempt}")
        if attempt > 0:  # the larger generation returns on its own
            pool._script.append([result(r, "done") for r in range(self.nodes)] + [Exited(r, 0) for r in range(self.nodes)])
        self.pools.append(pool)
        return pool

    def nodes_back(self):
        return ["n3"] if self.nodes < 3 and self.pools and self.pools[-1].polls > 3 else []

    def grow(self, names):
        self.nodes += len(names)
        return names


def test_the_session_calls_fn_again_on_more_nodes_and_lists_the_resize(monkeypatch):
    from nblaunch import session as session_module

    engine = FakeEngine()
    monkeypatch.setattr(session_module, "engine_for", lambda config, live, owner: engine)
    config = LaunchConfig(1, cluster="slurm", min_nodes=2, max_restarts=0, display="none", preempt_grace=5)
    results = session_module.Session(config, live=False).launch(lambda: None, [], {})
    assert list(results) == ["done"] * 3  # the resized generation's "generation 0" dropped
    assert results.restarts == ["restart 1 of 1: n3 back; 3 nodes, 3 ranks"]
    assert engine.pools[0].why == "resize: n3 is back"


def test_at_max_nodes_the_allocations_other_nodes_are_not_probed(fake_slurm):
    import threading

    config = LaunchConfig(1, cluster=slurm_engine.Slurm(job="12", nodes=2), max_restarts=1, min_nodes=1)
    engine = engine_for(config)
    engine.new_pool(None, 0).close()  # the first generation (never started): max_nodes is its nodes
    assert (engine.spare(), engine.max_nodes, engine.nodes_back()) == (["n3"], 2, [])
    assert "nblaunch-comebacks" not in [t.name for t in threading.enumerate()]
    engine.close()


# -- replacements for an allocation nblaunch asked for (engines/slurm_spares.py) ----------------

class _Request:
    """A replacement as :class:`Spares` sees one, without salloc: granted by the test."""

    def __init__(self, instead_of, exclude, job):
        self.instead_of, self.exclude, self.job = instead_of, exclude, job
        self.host, self.failed, self.cancelled = None, "", False

    @property
    def pending(self):
        return self.host is None and not self.failed

    def poll(self):
        pass

    def cancel(self):
        self.cancelled = True


def _spares():
    made = []

    def make(instead_of, exclude):
        made.append(_Request(instead_of, exclude, str(100 + len(made))))
        return made[-1]
    return Spares(make), made


def test_one_request_per_lost_node_within_the_room_max_nodes_leaves():
    spares, made = _spares()
    spares.ask(["n3"], room=1, exclude=["n1", "n2", "n3"])
    spares.ask(["n2"], room=2, exclude=["n1", "n2", "n3"])  # a second loss: one more, the first still pending
    spares.ask(["n1"], room=2, exclude=["n1", "n2", "n3"])  # no room for a third request
    assert [(r.instead_of, r.exclude) for r in made] == [("n3", ["n1", "n2", "n3"]), ("n2", ["n1", "n2", "n3"])]
    assert spares.said() == ["asked SLURM for a node in place of n3 (job 100): the run grows into it once granted",
                             "asked SLURM for a node in place of n2 (job 101): the run grows into it once granted"]


def test_a_granted_replacement_is_said_once_named_for_the_node_it_replaces_and_excluded_next_time():
    spares, made = _spares()
    spares.ask(["n3"], room=1, exclude=["n1", "n2", "n3"])
    spares.said()
    made[0].host = "n4"
    assert [r.host for r in spares.granted()] == ["n4"] and spares.job_of("n4") == "100"
    assert spares.said() == ["SLURM granted n4 (job 100) in place of n3"] and spares.said() == []
    assert spares.label("n4") == "n4 (in place of n3)" and spares.label("n1") == "n1"
    spares.lost(["n4"])  # the replacement lost in its turn: given back, and another asked for in its place
    assert made[0].cancelled and spares.granted() == []
    spares.ask(["n4"], room=1, exclude=["n1", "n2", "n3"])
    assert made[1].instead_of == "n4"


def test_at_max_nodes_the_unused_requests_and_replacements_are_given_back_and_said():
    spares, made = _spares()
    spares.ask(["n3", "n2"], room=2, exclude=["n1", "n2", "n3"])
    made[0].host = "n4"
    spares.said()
    given = spares.give_back(keep=["n1", "n3", "n4"], why="the run is on its 3 nodes again")
    assert given == [made[1]] and made[1].cancelled and not made[0].cancelled
    assert spares.said() == ["gave back the request (job 101), asked for in place of n2: the run is on its 3 nodes again"]
    spares.close()
    assert made[0].cancelled and spares.said() == []  # the end of the run gives everything back, silently


def test_a_refused_request_is_said_with_slurms_reason_then_forgotten():
    spares, made = _spares()
    spares.ask(["n3"], room=1, exclude=["n1"])
    spares.said()
    made[0].failed = "salloc: error: Job submit/allocate failed: Requested node configuration is not available"
    assert spares.said() == ["SLURM refused a node in place of n3: salloc: error: Job submit/allocate failed: "
                             "Requested node configuration is not available"]
    assert spares.said() == [] and spares.granted() == []


@pytest.mark.parametrize("fields, left", [
    ({"TimeLimit": "UNLIMITED", "EndTime": "Unknown"}, None),
    ({"TimeLimit": "01:00:00", "EndTime": "2026-12-07T18:30:00"}, 90),
    ({"TimeLimit": "01:00:00", "EndTime": "2026-12-07T16:59:50"}, 1),  # never below a minute
    ({"TimeLimit": "01:00:00"}, None),
])
def test_a_replacement_asks_for_the_time_the_allocation_has_left(fields, left):
    import datetime

    assert minutes_left(fields, now=datetime.datetime(2026, 12, 7, 17, 0, 0)) == left


# -- a launcher started again knocks at the next round of nodes joined by c10d (engines/rejoin.py) --

@pytest.fixture
def gate():
    import datetime
    import socket

    import torch.distributed as dist
    from nblaunch.engines.rejoin import Gate

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    yield lambda: Gate(dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10)), "run")
    del store


def test_a_late_launcher_knocks_at_the_round_after_the_one_running_and_is_counted_when_it_is_sealed(gate):
    kernel_a, late = gate(), gate()  # each its own client, as each launcher has
    assert late.current() is None  # before any loss: a launcher is one of the first
    kernel_a.set_current(1)
    assert late.knock(2, "10.0.0.3 (pid 7)") and late.knock(2, "10.0.0.4 (pid 8)")
    assert kernel_a.knocking(2) == ["10.0.0.3 (pid 7)", "10.0.0.4 (pid 8)"]
    assert kernel_a.seal(2) == ["10.0.0.3 (pid 7)", "10.0.0.4 (pid 8)"] == gate().seal(2)  # every node reads the same
    assert kernel_a.knocking(2) == []
    assert not late.knock(2, "10.0.0.5 (pid 9)")  # too late for that round: it knocks at the next one
    assert late.knock(3, "10.0.0.5 (pid 9)") and kernel_a.knocking(3) == ["10.0.0.5 (pid 9)"]


def test_the_first_resize_published_is_the_one_every_node_reads(gate):
    a, b = gate(), gate()
    assert a.resize(4) == []
    assert a.resize(4, ["x (pid 1)"]) == ["x (pid 1)"]
    assert b.resize(4, ["y (pid 2)"]) == ["x (pid 1)"] == b.resize(4)
    assert b.resize(5) == []  # each attempt its own


class GoneAgainEngine(FakeEngine):
    """n3 back during generation 0, gone again before generation 1 could start there."""

    def new_pool(self, job, attempt):
        if attempt == 1:
            from nblaunch.errors import LaunchError

            raise LaunchError("the agent on node 2 (n3) ended before it started its ranks")
        return super().new_pool(job, attempt)

    def ungrow(self, names):
        self.nodes -= len(names)
        self.ungrown = names
        return True


def test_a_node_back_that_goes_again_before_the_larger_generation_starts_is_left_out_and_the_run_goes_on(
        monkeypatch):
    from nblaunch import session as session_module

    engine = GoneAgainEngine()
    monkeypatch.setattr(session_module, "engine_for", lambda config, live, owner: engine)
    config = LaunchConfig(1, cluster="slurm", min_nodes=2, max_restarts=0, display="none", preempt_grace=5)
    engine.nodes_back = lambda: ["n3"] if len(engine.pools) == 1 and engine.pools[-1].polls > 3 else []
    results = session_module.Session(config, live=False).launch(lambda: None, [], {})
    assert engine.ungrown == ["n3"] and len(results) == 2  # on the two nodes it had
    assert results.restarts == ["restart 1 of 1: n3 back; 3 nodes, 3 ranks",
                                "restart 2 of 2: n3 back, gone again before it could be used; 2 nodes, 2 ranks"]


def test_past_an_hour_the_summary_counts_hours():
    from nblaunch.watch.restarts import _clock

    assert (_clock(0), _clock(724.9), _clock(3600), _clock(94324)) == ("0:00", "12:04", "1:00:00", "26:12:04")


def test_a_request_slurm_would_not_take_is_said_and_the_run_goes_on():
    from nblaunch.errors import LaunchError

    def make(instead_of, exclude):
        raise LaunchError("`scontrol show job 12` did not answer within 30 s: is slurmctld up?")
    spares = Spares(make)
    assert spares.ask(["n3"], room=1, exclude=["n1", "n2", "n3"]) == []
    assert spares.said() == ["could not ask SLURM for a node in place of n3: `scontrol show job 12` did not answer "
                             "within 30 s: is slurmctld up?"]
