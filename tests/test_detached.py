"""Launches work whatever started the process (issue 35): a job left behind
by a shell script that has exited (its parent and its process group's leader
gone), cron's bare environment, setsid, a subreaper, PID 1 of a container.
Each case runs tests/detached_launch.py the way that case starts a process
and checks that every start method launched, and that nothing is left."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import matrix, wait_gone

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ways Linux starts a job"),
              pytest.mark.timeout(300)]

SCRIPT = os.path.join(os.path.dirname(__file__), "detached_launch.py")
EXPECTED = [[0, 2.0], [1, 2.0]]


def _script(out, token, starter="$$") -> str:
    return " ".join(shlex.quote(a) for a in (sys.executable, SCRIPT, str(out), token)) + f" {starter}"


def _cases(out, token):
    """name -> (argv, Popen kwargs): how each case starts the launch."""
    job = _script(out, token)
    left = f"nohup {job} > {shlex.quote(str(out))}.log 2>&1 &"
    reaper = ("import ctypes, subprocess, sys; ctypes.CDLL(None).prctl(36, 1); "  # PR_SET_CHILD_SUBREAPER
              "subprocess.run(['bash', '-c', sys.argv[1]], start_new_session=True); "
              "import os; os.waitpid(-1, 0)")
    return {
        # A script run from an interactive shell (its own process group) that
        # leaves a job running and exits: the job's parent and group leader are gone.
        "nohup from a script that exits": (["bash", "-c", left], {"start_new_session": True}),
        # cron: no TTY, stdin from /dev/null, a bare environment, its shell gone.
        "cron": (["env", "-i", "PATH=/usr/bin:/bin", "HOME=/tmp", "SHELL=/bin/sh", "bash", "-c", left],
                 {"start_new_session": True, "stdin": subprocess.DEVNULL}),
        # setsid -f: the job leads a session of its own; what ran setsid is gone.
        "setsid": (["setsid", "-f", "bash", "-c", f"exec {_script(out, token, 0)}"], {}),
        # A supervisor that adopts orphans (systemd --user, tini, a CI runner).
        "subreaper": ([sys.executable, "-c", reaper, left], {}),
        # PID 1 of a container: a pid namespace of its own.
        "pid 1 of a container": (["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c",
                                  f"exec {_script(out, token, 0)}"], {}),
    }


def _find(token: str, timeout: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            if token in (p.info["cmdline"] or []) and SCRIPT in (p.info["cmdline"] or []):
                return p
        time.sleep(0.02)
    raise AssertionError("the launch never started")


@pytest.mark.parametrize("case", ["nohup from a script that exits",
                                  *matrix("pid 1 of a container", "cron", "setsid", "subreaper")])
def test_a_launch_works_whatever_started_the_process(case, tmp_path):
    out, token = tmp_path / "result.json", f"nblaunch-test-{uuid.uuid4().hex}"
    argv, kwargs = _cases(out, token)[case]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed")
    starter = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kwargs)
    seen: dict[int, psutil.Process] = {}
    try:
        if case == "pid 1 of a container":
            try:
                starter.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if starter.returncode not in (None, 0):
                pytest.skip(f"cannot make a pid namespace here: {starter.stderr.read().strip()}")
        job = _find(token)
        deadline = time.monotonic() + 240
        while not out.exists() and time.monotonic() < deadline:  # note all it starts, to check they end
            try:
                for p in job.children(recursive=True):
                    seen.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        log = (tmp_path / "result.json.log")
        assert out.exists(), log.read_text() if log.exists() else "no result and no log"
        report = json.loads(out.read_text())
        facts = report["facts"]
        assert facts["starter_gone"]
        if case in ("nohup from a script that exits", "cron", "subreaper"):
            assert facts["group_leader_gone"] and not facts["leads_group"], facts
        if case == "setsid":
            assert facts["leads_group"], facts
        if case == "pid 1 of a container":
            assert facts["pid"] == 1, facts
        if case == "cron":
            assert not facts["stdin_tty"] and "TERM" not in facts["env"], facts
        assert report["results"] == {m: EXPECTED for m in ("fork", "forkserver", "spawn")}
        assert wait_gone([job.pid], timeout=30) == []
        assert wait_gone(list(seen), timeout=10) == [], [seen[p].pid for p in seen]
    finally:
        for p in [*seen.values(), *([job] if "job" in locals() else [])]:
            try:
                p.kill()
            except psutil.Error:
                pass
        if starter.poll() is None:
            starter.kill()
        starter.wait()


def test_a_process_is_known_by_its_pid_and_start_time():
    from nblaunch.system import procid

    me = procid.identity(os.getpid())
    assert procid.same_process(me)
    pid, started = me.split(":")
    assert not procid.same_process(f"{pid}:{int(started) + 1}")  # that pid, reused by another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = procid.identity(child.pid)
    child.wait()
    assert not procid.same_process(ident) and procid.gone(child.pid)
