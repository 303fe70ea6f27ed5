"""Which frames are nblaunch's own: by the modules' real locations, never by a
folder's name (process-free: runs in milliseconds)."""
from __future__ import annotations

import multiprocessing
import os
import threading

import nblaunch
from nblaunch.rank import stacks
from nblaunch.errors import RankFailure, WorkerError
from nblaunch.rank.frames import is_machinery

PACKAGE = os.path.dirname(nblaunch.__file__)
MP = os.path.dirname(multiprocessing.__file__)


def test_the_package_and_the_start_up_modules_are_machinery():
    assert is_machinery(os.path.join(PACKAGE, "worker.py"))
    assert is_machinery(os.path.join(MP, "process.py"))
    assert is_machinery(threading.__file__)


def test_a_users_folder_named_like_the_package_is_not_machinery(tmp_path):
    for folder in ("nblaunch", "multiprocessing", "nblaunch/nblaunch_extra"):
        assert not is_machinery(str(tmp_path / folder / "train.py")), folder
    assert not is_machinery(PACKAGE + "_helpers/train.py")  # a sibling whose name starts the same
    assert not is_machinery(os.path.join(os.path.dirname(PACKAGE), "tests", "cases.py"))  # this clone's tests
    assert not is_machinery("<dynamic-code>") and not is_machinery("")


def test_a_symlinked_package_path_is_still_machinery(tmp_path):
    link = tmp_path / "lib64"
    link.symlink_to(os.path.dirname(PACKAGE))
    assert is_machinery(str(link / "nblaunch" / "worker.py"))


def _crash(lines):
    failure = RankFailure(rank=0, kind="signal", time=1.0, signal=11, last_lines=tuple(lines))
    return str(WorkerError([failure])).split("crashed")[1]


def test_a_crash_keeps_the_users_frames_under_a_folder_named_nblaunch():
    user = "/home/ada/nblaunch/experiments/segv.py"
    shown = _crash([
        "about to crash",
        "Fatal Python error: Segmentation fault",
        "",
        "Current thread 0x00007f (most recent call first):",
        '  File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at',
        f'  File "{user}", line 7 in segfault_on_rank_0',
        f'  File "{os.path.join(PACKAGE, "worker.py")}", line 111 in run_worker',
        f'  File "{os.path.join(MP, "process.py")}", line 108 in run',
        '  File "<string>", line 1 in <module>',
        "",
    ])
    assert f'File "{user}", line 7 in segfault_on_rank_0' in shown
    assert "string_at" in shown
    assert "run_worker" not in shown and "process.py" not in shown


def test_stacks_drop_the_launchers_frames_but_not_a_users_wait():
    assert stacks._plumbing(os.path.join(PACKAGE, "worker.py"), "run_worker")
    assert stacks._plumbing(threading.__file__, "_bootstrap_inner")
    assert not stacks._plumbing(threading.__file__, "wait")  # where a rank waits on an Event
    assert not stacks._plumbing("/srv/nblaunch/train.py", "train")
