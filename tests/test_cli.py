"""The ``nblaunch`` command (issue 51): detached runs, submitted by a script
that has exited, listed, followed, read, stopped and forgotten from a
terminal, through the library's own run-folder code; no torch or ipywidgets
imported, an answer in under a second; a bad id is one line and status 2;
Ctrl-C leaves ``attach`` and never the run."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from conftest import wait_for_file, wait_gone
from nblaunch.background.detached import detached_runs
from nblaunch.background.listing import RunList, duration, progress, row, text_table
from nblaunch.view.state import BarState, LaunchState, RankState

pytestmark = pytest.mark.timeout(300)

SUBMIT = """
import os, sys, time, nblaunch

def train(gate, steps, fail):
    import torch
    open(f"{gate}.{os.environ['RANK']}.up", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.02)
    for step in nblaunch.progress(range(steps), desc="train"):
        print("step", step, flush=True)
    if fail and os.environ["RANK"] == "1":
        raise ValueError("rank 1 gave up")
    return torch.ones(2) * int(os.environ["RANK"])  # a tensor: listing must not unpickle it

for gate, fail in zip(sys.argv[1::2], sys.argv[2::2]):
    run = nblaunch.submit(train, args=(gate, 3, fail == "fail"), num_processes=2, display="none", detach=True)
    print(run.id, flush=True)
"""


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    where = tmp_path / "runs"
    monkeypatch.setenv("NBLAUNCH_RUNS_DIR", str(where))
    yield where
    for run in detached_runs():  # whatever a failed test left running
        run.forget()


def submit(tmp_path, *gates) -> list:
    """Run ids, submitted by a script that then exits (as from SSH): ``gates``: (gate path, "ok" or "fail")."""
    script = tmp_path / "submit.py"
    script.write_text(SUBMIT)
    out = subprocess.run([sys.executable, str(script)] + [x for g in gates for x in g], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nblaunch", *args], capture_output=True, text=True,
                          timeout=timeout)


def supervisor(runs_dir, run_id) -> int:
    return int((runs_dir / run_id / "supervisor.id").read_text().split(":")[0])


def test_a_run_listed_followed_left_and_forgotten_from_a_terminal(runs_dir, tmp_path):
    gate = str(tmp_path / "gate")
    [run_id] = submit(tmp_path, (gate, "ok"))
    for rank in range(2):
        wait_for_file(f"{gate}.{rank}.up")
    listed = cli("runs")
    assert listed.returncode == 0 and run_id in listed.stdout and "running" in listed.stdout, listed
    assert listed.stdout.split("\n")[0].split() == ["ID", "STATE", "RANKS", "PROGRESS", "STARTED", "TOOK"]
    follower = subprocess.Popen([sys.executable, "-m", "nblaunch", "logs", run_id, "-f"], stdout=subprocess.PIPE,
                                text=True)
    attached = subprocess.Popen([sys.executable, "-m", "nblaunch", "attach", run_id], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        assert "[nblaunch] starting 2 ranks" in attached.stdout.readline()  # its view, drawn from the folder
        attached.send_signal(signal.SIGINT)  # Ctrl-C: leave the view, not the run
        assert attached.wait(30) == 130
        assert "left run" in attached.stderr.read() and psutil.pid_exists(supervisor(runs_dir, run_id))
        open(gate, "w").close()
        followed, _ = follower.communicate(timeout=120)  # -f ends with the run
    finally:
        for p in (follower, attached):
            p.kill() if p.poll() is None else None
    assert follower.returncode == 0
    assert sorted(followed.splitlines()) == sorted(f"[rank {r}] step {s}" for s in range(3) for r in range(2))
    again = cli("attach", run_id)
    assert again.returncode == 0 and "[rank 1] step 2" in again.stdout and "finished" in again.stdout, again
    assert cli("logs", run_id, "--rank", "1").stdout == "step 0\nstep 1\nstep 2\n"
    [seen] = json.loads(cli("runs", "--json").stdout)
    assert (seen["id"], seen["state"], seen["ranks"], seen["progress"]) == (run_id, "finished", "2",
                                                                             "train 3/3 (100%)")
    gone = cli("forget", run_id)
    assert gone.returncode == 0 and not (runs_dir / run_id).exists()
    assert "no detached runs" in cli("runs").stdout


def test_attach_says_how_a_run_ended_and_stop_ends_one(runs_dir, tmp_path):
    failing, never = str(tmp_path / "failing"), str(tmp_path / "never")
    open(failing, "w").close()
    fails_id, stopped_id = submit(tmp_path, (failing, "fail"), (never, "ok"))
    failed = cli("attach", fails_id)
    assert failed.returncode == 1 and "rank 1 raised ValueError: rank 1 gave up" in failed.stderr, failed
    for rank in range(2):
        wait_for_file(f"{never}.{rank}.up")
    ranks_of = supervisor(runs_dir, stopped_id)
    stopped = cli("stop", stopped_id)
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"run {stopped_id}: stopped", stopped
    assert not wait_gone([ranks_of], timeout=10)
    assert cli("attach", stopped_id).returncode == 1
    states = {r["id"]: r["state"] for r in json.loads(cli("runs", "--json").stdout)}
    assert states == {fails_id: "failed", stopped_id: "stopped"}


@pytest.mark.parametrize("args", [["attach", "nope"], ["logs", "../etc"], ["stop", ".."], ["forget", "a/b"]])
def test_an_unknown_or_malformed_id_is_one_line_and_status_2(runs_dir, args):
    out = cli(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("nblaunch: "), out.stderr


def test_the_command_imports_neither_torch_nor_ipywidgets_and_answers_in_under_a_second(runs_dir, tmp_path):
    (runs_dir / "not-a-run").mkdir(parents=True)  # a folder without a run: not listed
    log = subprocess.run([sys.executable, "-X", "importtime", "-m", "nblaunch", "runs"], capture_output=True,
                         text=True, timeout=60)
    assert log.returncode == 0 and "no detached runs" in log.stdout, log.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in log.stderr.splitlines() if "|" in line}
    assert "nblaunch.background.folder" in imported
    assert not imported & {"torch", "ipywidgets", "IPython"}
    # The command's own CPU time: its wall time is that plus the wait for a
    # CPU, which a machine shared by other test runs makes long at times
    # (0.54-0.58 s idle; 1.0-1.3 s at a load of 10 on 2 cores).
    took = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert cli("runs").returncode == 0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        took.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    assert min(took) < 1.0, took


# -- the tables, without a process ------------------------------------------------------------

def _state(*bars) -> LaunchState:
    state = LaunchState()
    state.begin(len(bars), "fork", "gloo", "/logs")
    for rank, (n, total) in zip(state.ranks, bars):
        rank.bars["b"] = BarState(desc="train", n=n, total=total)
    return state


def test_progress_is_the_slowest_ranks_bar():
    assert progress(_state((412, 1000), (700, 1000))) == "train 412/1000 (41%)"
    assert progress(_state((5, None))) == "train 5"
    assert progress(None) == "" and progress(LaunchState()) == ""


def test_durations_read_as_people_say_them():
    assert [duration(s) for s in (0, 42, 185, 7620)] == ["0 s", "42 s", "3 min 05 s", "2 h 07 min"]


def test_a_list_of_runs_is_a_table_in_a_notebook_and_in_a_terminal():
    config = SimpleNamespace(num_processes=1, num_nodes=2)
    run = SimpleNamespace(id="1207-1-<b>", status="running", detached=True, config=config, started_at=1000.0,
                          ended_at=None, log_dir="", view_state=lambda: _state((1, 4), (2, 4)))
    shown = row(run, now=1042.0)
    assert (shown["ranks"], shown["progress"], shown["took"]) == ("2 on 2 nodes", "train 1/4 (25%)", "42 s")
    table = RunList([run])
    assert isinstance(table, list) and table == [run]
    page = table._repr_html_()
    assert "<th style='text-align:left'>progress</th>" in page and "1207-1-&lt;b&gt;" in page
    assert RunList()._repr_html_() == "<i>nblaunch: no runs</i>"
    lines = text_table([shown]).splitlines()
    assert lines[0].split() == ["ID", "STATE", "RANKS", "PROGRESS", "STARTED", "TOOK"]
    assert lines[1].startswith("1207-1-<b>  running  2 on 2 nodes  train 1/4 (25%)")
