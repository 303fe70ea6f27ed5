"""Ranks on the executors of a real Spark application (issue 49).

One kernel for the module holds a ``local-cluster[2,2,1024]`` session (two
executor JVMs of two cores each on this host, pip's pyspark, Java 17, graceful
decommission on), made once: what a Databricks user's notebook has. The
tests that lose or decommission an executor come last (Spark replaces it).
Marked ``spark``: the README's test command leaves them out (pyspark is an
extra and each session starts three JVMs), ``.ci/run`` runs them
(``pytest -m spark``). Without pyspark or Java they skip, unless
``NBLAUNCH_REQUIRE_SPARK`` is set (CI), when they fail.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import Kernel, _descendants, wait_gone

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

try:
    import pyspark  # noqa: F401
    _WHY_NOT = "" if shutil.which("java") else "Java is not installed (apt-get install openjdk-17-jre-headless)"
except ImportError:
    _WHY_NOT = "pyspark is not installed (pip install -e '.[spark]')"
if _WHY_NOT and os.environ.get("NBLAUNCH_REQUIRE_SPARK"):
    raise RuntimeError(f"NBLAUNCH_REQUIRE_SPARK is set, but {_WHY_NOT}")
if _WHY_NOT:
    pytest.skip(_WHY_NOT, allow_module_level=True)

MARK = "NBLAUNCH_SPARK_TEST"  # in the kernel's environment, which the agents (and ranks) get
SESSION = """
import os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local-cluster[2,2,1024]").config("spark.ui.enabled", "false")
         .config("spark.executor.memory", "900m").config("spark.decommission.enabled", "true").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
"""


def _ours() -> list[psutil.Process]:
    """This module's agents and their ranks (forked agents: the same command line), zombies aside."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or "nblaunch.engines.agent" not in " ".join(
                    p.info["cmdline"] or []):
                continue
            if p.environ().get(MARK) == str(os.getpid()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _nothing_left(timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in _ours()]
    assert not left, f"agents or ranks left on the executors: {left}"


def _ok(result) -> str:
    assert result.error is None, "\n".join(result.error["traceback"])
    return result.text


@pytest.fixture(autouse=True)
def no_process_left():
    """conftest's, less the Spark application's own processes (its JVMs and
    Python workers, which it keeps for the module's session): what a launch
    starts (agents, ranks) must be gone."""
    before = set(_descendants())
    yield
    leftover = [pid for pid in _descendants() if pid not in before and not _sparks(pid)]
    still = wait_gone(leftover, timeout=10)
    assert not still, f"processes left behind: {still}"


def _sparks(pid: int) -> bool:
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return "pyspark.daemon" in cmd or "pyspark.worker" in cmd or "org.apache.spark" in cmd


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(extra_env={MARK: str(os.getpid())})
    try:
        _ok(k.execute(SESSION, timeout=240))
        yield k
    finally:
        k.shutdown()
        _nothing_left()


@pytest.fixture
def spark_kernel(kernel):
    yield kernel
    _nothing_left()


def test_every_rank_runs_on_an_executor_with_its_result_and_output(spark_kernel):
    text = _ok(spark_kernel.execute("""
import os, time, nblaunch
os.environ["FROM_THE_NOTEBOOK"] = "yes"
def executor():
    import psutil
    p = psutil.Process()
    while p is not None:  # up to the executor's JVM: rank, agent, Spark's Python worker, its daemon
        cmd = p.cmdline()
        if "--executor-id" in cmd:
            return cmd[cmd.index("--executor-id") + 1]
        p = p.parent()
def where():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} here", flush=True)
    return dist.get_rank(), int(os.environ["NODE_RANK"]), t.item(), os.environ.get("FROM_THE_NOTEBOOK"), executor()
out = nblaunch.notebook_launcher(where, num_processes=2, cluster="spark", display="text")
print([r[:4] for r in out])
print("executors by node", [out[0][4], out[2][4]])""", timeout=240))
    # One node per executor, every rank's result in rank order, with the kernel's environment.
    assert "[(0, 0, 4.0, 'yes'), (1, 0, 4.0, 'yes'), (2, 1, 4.0, 'yes'), (3, 1, 4.0, 'yes')]" in text, text
    for r in range(4):
        assert f"[rank {r}] rank {r} here" in text, text
    # Each executor has two cores, room for two tasks: still one node on each.
    found = re.search(r"executors by node \['(\d+)', '(\d+)'\]", text)
    assert found and found.group(1) != found.group(2), text


def test_a_failing_rank_is_named_with_its_executor_and_spark_reruns_nothing(spark_kernel):
    _ok(spark_kernel.execute("""
import time, nblaunch
def fn():
    import torch, torch.distributed as dist
    if dist.get_rank() == 3:
        time.sleep(0.5)
        raise ValueError("bad shard on the second executor")
    t = torch.ones(1)
    dist.all_reduce(t)
"""))
    r = spark_kernel.execute("nblaunch.notebook_launcher(fn, num_processes=2, cluster='spark', display='text')",
                             timeout=240)
    assert r.error is not None and r.error["ename"] == "WorkerError"
    tb = "\n".join(r.error["traceback"])
    assert re.search(r"rank 3 on [\w.-]+ \(executor \d+\) raised ValueError: bad shard on the second executor", tb), tb
    # Spark saw every task succeed: no stage was attempted twice, no task failed.
    text = _ok(spark_kernel.execute("""
st = spark.sparkContext.statusTracker()
stages = [st.getStageInfo(s) for j in range(100) if st.getJobInfo(j) for s in st.getJobInfo(j).stageIds]
print("attempts", sorted({s.currentAttemptId for s in stages if s}), "failed", sum(s.numFailedTasks for s in stages if s))
"""))
    assert "attempts [0] failed 0" in text, text


def test_live_ranks_keep_state_and_the_stop_button_ends_every_rank(spark_kernel):
    _ok(spark_kernel.execute("""
import time, nblaunch
ranks = nblaunch.start(1, cluster="spark", display="text")
def bump():
    global count
    count = globals().get("count", 0) + 1
    return count
def spin():
    print("spinning", flush=True)
    while True:
        time.sleep(0.01)
""", timeout=240))
    _ok(spark_kernel.execute("ranks.run(bump)"))
    msg = spark_kernel.execute_async("ranks.run(spin)")
    spark_kernel.wait_for_output("spinning", timeout=60)
    time.sleep(0.5)  # every rank in its loop (the output of one is enough to know the call began)
    spark_kernel.km.interrupt_kernel()
    r = spark_kernel.wait_for_reply(msg, timeout=60)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    assert "[2, 2]" in _ok(spark_kernel.execute("print(ranks.run(bump, display='none'))"))  # state kept
    _ok(spark_kernel.execute("ranks.close()"))
    _nothing_left()


def test_the_stop_button_ends_a_launch_and_its_spark_job(spark_kernel):
    msg = spark_kernel.execute_async("""
import time, nblaunch
def wait():
    print("waiting", flush=True)
    time.sleep(120)
nblaunch.notebook_launcher(wait, num_processes=1, cluster="spark", display="text")""")
    spark_kernel.wait_for_output("waiting", timeout=120)
    assert len(_ours()) >= 2 + 2  # an agent and a rank on each executor
    t0 = time.monotonic()
    spark_kernel.km.interrupt_kernel()
    r = spark_kernel.wait_for_reply(msg, timeout=60)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - t0 < 20
    _nothing_left()
    _no_spark_job_left(spark_kernel)


def _no_spark_job_left(kernel, timeout: float = 60) -> None:
    """The launch's Spark job ends (Spark's bookkeeping, apart from the cell's verdict, takes a moment)."""
    text = _ok(kernel.execute(f"""
import time
deadline = time.monotonic() + {timeout}
while spark.sparkContext.statusTracker().getActiveJobsIds() and time.monotonic() < deadline:
    time.sleep(0.1)
print('active', spark.sparkContext.statusTracker().getActiveJobsIds())""", timeout=timeout + 30))
    assert "active []" in text, text


def test_more_nodes_than_the_executors_hold_is_refused_before_any_task(spark_kernel):
    # Two executors of two cores: four tasks at once, but one node each.
    r = spark_kernel.execute("nblaunch.notebook_launcher(print, num_processes=1, cluster=nblaunch.Spark(nodes=3))")
    assert r.error is not None and r.error["ename"] == "LaunchError"
    assert "run 2 tasks at once: a barrier stage of 3 tasks would wait forever" in r.error["evalue"], r.error


def test_a_failure_reaches_the_cell_without_waiting_for_spark_to_end_the_stage(spark_kernel):
    """The verdict waits for the agents, not for Spark's end of the stage
    (seconds of a busy driver's bookkeeping): here each task lingers 60 s
    after its agent has left, and the error is in the cell within seconds of
    the raise while the stage still runs; the next launch waits for the
    stage to be ended (cancelled) and runs."""
    text = _ok(spark_kernel.execute("""
import os, re, time, nblaunch, torch
from nblaunch.engines import spark_task
agent_task = spark_task.run_agent
def lingering(*args):
    yield from agent_task(*args)
    time.sleep(60)
def fails():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError(f"raised at {time.time()!r}")
    dist.all_reduce(torch.ones(1))
spark_task.run_agent = lingering
try:
    nblaunch.notebook_launcher(fails, num_processes=1, cluster="spark", display="none")
except nblaunch.WorkerError as exc:
    seen = time.time()
    raised = float(re.search(r"raised at ([0-9.]+)", str(exc)).group(1))
    print(f"raise to the cell {seen - raised:.2f} s; jobs running {spark.sparkContext.statusTracker().getActiveJobsIds()}")
finally:
    spark_task.run_agent = agent_task
print("next", list(nblaunch.notebook_launcher(os.getpid, num_processes=1, cluster="spark", display="none")) != [])
""", timeout=240))
    found = re.search(r"raise to the cell ([0-9.]+) s; jobs running \[(\d*)", text)
    assert found and found.group(2), text  # the stage was still running
    assert float(found.group(1)) < 10, text
    assert "next True" in text, text
    _no_spark_job_left(spark_kernel)


def test_without_a_session_the_error_says_how_to_make_one():
    import nblaunch

    with pytest.raises(nblaunch.LaunchError, match=r"there is none: make one first \(spark = SparkSession"):
        nblaunch.notebook_launcher(print, num_processes=1, cluster="spark")


def test_detach_is_refused_on_spark_with_the_reason():
    import nblaunch

    with pytest.raises(ValueError, match="a Spark application lives in its driver"):
        nblaunch.submit(print, num_processes=1, cluster="spark", detach=True)


def test_a_spark_spec_is_picklable_and_leaves_its_session_in_the_kernel():
    import nblaunch

    class Session:
        sparkContext = None

        def __reduce__(self):
            raise AssertionError("a session was pickled")

    spec = nblaunch.Spark(nodes=2, session=Session())
    back = pickle.loads(pickle.dumps(spec))
    assert back == nblaunch.Spark(nodes=2) and back.session is None and hash(back) == hash(spec)
    with pytest.raises(ValueError, match=r"Spark\(nodes=...\) must be a positive int"):
        nblaunch.Spark(nodes=0)


def test_a_local_mode_session_runs_the_ranks_here_and_says_so(tmp_path):
    script = textwrap.dedent("""
        import os, sys
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession
        import nblaunch
        spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
        print(list(nblaunch.notebook_launcher(os.getpid, num_processes=2, cluster="spark", display="text")))
        print("kernel", os.getpid())
        spark.stop()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the SparkSession runs in local mode (one JVM, no executors): the ranks run on this machine" in done.stdout
    assert re.search(r"\[\d+, \d+\]", done.stdout), done.stdout


# --- a lost or decommissioned executor: these change the application's executors, so they come last ---

STEPPER = """
import os, time, nblaunch
def executor():
    import psutil
    p = psutil.Process()
    while p is not None:  # up to the executor's JVM: rank, agent, Spark's Python worker, its daemon
        cmd = p.cmdline()
        if "--executor-id" in cmd:
            return cmd[cmd.index("--executor-id") + 1]
        p = p.parent()
def stepper(folder, steps=8):
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint = os.path.join(folder, "checkpoint")
    start = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
    bar = nblaunch.progress(total=steps, desc="train")
    t = torch.ones(1)
    for step in range(start, steps):
        dist.all_reduce(t)
        if rank == 0:
            with open(checkpoint + ".new", "w") as f:
                f.write(str(step + 1))
            os.replace(checkpoint + ".new", checkpoint)
        bar.update(1)
        if restart == 0 and step == 3:
            open(os.path.join(folder, f"at-3-{rank}"), "w").close()
            time.sleep(120)  # until a node is lost
    return (restart, rank, world, start, executor())
"""


def _wait_files(folder, prefix: str, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len([f for f in os.listdir(folder) if f.startswith(prefix)]) < n:
        assert time.monotonic() < deadline, os.listdir(folder)
        time.sleep(0.05)


def _agent_of(node: int) -> psutil.Process:
    """Node ``node``'s agent (its ranks, forked from it, share its command line; its parent is Spark's worker)."""
    for p in _ours():
        try:
            if (p.environ().get("NBLAUNCH_NODE") == str(node)
                    and "nblaunch.engines.agent" not in " ".join(p.parent().cmdline())):
                return p
        except psutil.Error:
            pass
    raise AssertionError(f"no agent of node {node} among {[p.pid for p in _ours()]}")


def _executor_jvm(agent: psutil.Process) -> tuple[psutil.Process, str]:
    """The executor JVM an agent runs under (its worker's daemon's parent), and the executor's id."""
    p = agent
    while p is not None:
        cmd = p.cmdline()
        if "--executor-id" in cmd:
            return p, cmd[cmd.index("--executor-id") + 1]
        p = p.parent()
    raise AssertionError(f"agent {agent.pid} runs under no executor")


def test_a_node_whose_agent_dies_is_named_with_its_executor(spark_kernel, tmp_path):
    _ok(spark_kernel.execute(STEPPER))
    msg = spark_kernel.execute_async(f"nblaunch.notebook_launcher(stepper, ({str(tmp_path)!r},), num_processes=1, "
                                     "cluster='spark', display='text')")
    _wait_files(tmp_path, "at-3-", 2)
    agent = _agent_of(1)
    _, executor = _executor_jvm(agent)
    agent.kill()
    r = spark_kernel.wait_for_reply(msg, timeout=120)
    assert r.error is not None and r.error["ename"] == "WorkerError", r.error
    tb = "\n".join(r.error["traceback"])
    assert re.search(rf"node 1 \(\S+ \(executor {executor}\)\) was lost", tb), tb
    _no_spark_job_left(spark_kernel)


def test_a_lost_executor_with_min_nodes_goes_on_from_a_checkpoint_without_it(spark_kernel, tmp_path):
    """The executor's JVM is killed mid-run (its Python workers, the agent
    and its ranks go with it): with min_nodes=1 the next generation runs on
    one node, from the checkpoint the first one left."""
    _ok(spark_kernel.execute(STEPPER))
    msg = spark_kernel.execute_async(f"res = nblaunch.notebook_launcher(stepper, ({str(tmp_path)!r},), "
                                     "num_processes=1, cluster='spark', max_restarts=1, min_nodes=1, display='text')\n"
                                     "print(list(res))")
    _wait_files(tmp_path, "at-3-", 2)
    jvm, executor = _executor_jvm(_agent_of(1))
    jvm.kill()
    text = _ok(spark_kernel.wait_for_reply(msg, timeout=240))
    found = re.search(r"\[\(1, 0, 1, 4, '(\d+)'\)\]", text)  # one rank, from step 4 on, on another executor
    assert found and found.group(1) != executor, text
    assert re.search(rf"restart 1 of 1: node \S+ \(executor {executor}\) lost at step 4; 1 ranks", text), text
    _no_spark_job_left(spark_kernel)


GROWER = """
import os, time, nblaunch
def grower(folder, steps=1500):
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    for step in range(20 if restart == 2 else steps):
        dist.all_reduce(t)
        if step == 0:
            with open(os.path.join(folder, f"first-{restart}-{rank}"), "w") as f:
                f.write(executor())
        if nblaunch.preempted(agree=True):
            with open(os.path.join(folder, f"notice-{restart}-{rank}"), "w") as f:
                f.write(nblaunch.preempt_reason())
            return (restart, rank, world, "resized")
        time.sleep(0.1)
    return (restart, rank, world, executor())
"""


def _two_executors(kernel) -> None:
    """Spark replaces an executor lost (half a minute here): a launch on two nodes needs both."""
    assert "executors 2" in _ok(kernel.execute("""
import time
deadline = time.monotonic() + 180
while spark.sparkContext._jsc.sc().getExecutorIds().size() < 2 and time.monotonic() < deadline:
    time.sleep(0.2)
print("executors", spark.sparkContext._jsc.sc().getExecutorIds().size())""", timeout=240))


def test_after_a_lost_executor_its_replacement_is_taken_and_the_run_is_on_two_nodes_again(spark_kernel, tmp_path):
    """Issue 48: min_nodes=1 on both executors, one JVM killed; the run goes on on one, Spark
    starts an executor in its place, and once it has stayed registered for node_back_after
    every rank gets the notice (``resize: executor N is back``) and fn runs on two again."""
    _two_executors(spark_kernel)
    _ok(spark_kernel.execute(STEPPER + GROWER))
    msg = spark_kernel.execute_async(f"res = nblaunch.notebook_launcher(grower, ({str(tmp_path)!r},), "
                                     "num_processes=1, cluster='spark', max_restarts=1, min_nodes=1, "
                                     "node_back_after=3, preempt_grace=20, display='text')\n"
                                     "print(list(res)); print(res.restarts)")
    _wait_files(tmp_path, "first-0-", 2)
    jvm, executor = _executor_jvm(_agent_of(1))
    jvm.kill()
    _wait_files(tmp_path, "first-1-", 1)
    t_lost = time.monotonic()
    _wait_files(tmp_path, "first-2-", 2, timeout=240)
    grown = time.monotonic() - t_lost
    text = _ok(spark_kernel.wait_for_reply(msg, timeout=120))
    on = sorted((tmp_path / f"first-2-{r}").read_text() for r in range(2))
    assert executor not in on and len(set(on)) == 2, on  # two executors, the lost one not among them
    new = next(e for e in on if e != (tmp_path / "first-1-0").read_text())
    assert (tmp_path / "notice-1-0").read_text() == f"resize: executor {new} is back"
    assert re.search(rf"restart 2 of 2: executor {new} back; 2 nodes, 2 ranks", text), text
    assert "[(2, 0, 2, " in text and "(2, 1, 2, " in text, text
    print(f"on two executors again {grown:.1f} s after the survivor's first step (Spark's replacement included)")
    _no_spark_job_left(spark_kernel)


PREEMPTED = """
import os, time, nblaunch
def until_preempted(folder):
    import torch.distributed as dist
    open(os.path.join(folder, f"up-{dist.get_rank()}"), "w").close()
    step = 0
    while not nblaunch.preempted(agree=True):
        step += 1
        time.sleep(0.05)
    return (dist.get_rank(), step)
"""


def test_an_executor_being_decommissioned_lets_every_rank_save_and_return(spark_kernel, tmp_path):
    """Spark's graceful decommission (SIGPWR to the executor, what a spot
    instance's notice becomes): a preemption notice to every rank on every
    executor, which agree on a step and return."""
    _ok(spark_kernel.execute(PREEMPTED))
    _two_executors(spark_kernel)
    msg = spark_kernel.execute_async(f"res = nblaunch.notebook_launcher(until_preempted, ({str(tmp_path)!r},), "
                                     "num_processes=1, cluster=nblaunch.Spark(nodes=2), display='text')\n"
                                     "print(list(res))")
    _wait_files(tmp_path, "up-", 2)
    jvm, executor = _executor_jvm(_agent_of(1))
    jvm.send_signal(signal.SIGPWR)
    text = _ok(spark_kernel.wait_for_reply(msg, timeout=120))
    found = re.findall(r"\((\d), (\d+)\)", text)
    assert [r for r, _ in found] == ["0", "1"] and len({s for _, s in found}) == 1, text
    assert f"preempted (a decommission to Spark executor {executor}): saving" in text, text
