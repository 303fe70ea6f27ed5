"""Forked ranks come from one zygote (nblaunch/zygote.py): a copy of the
kernel made ready to be a rank once, so that each rank shares those pages
instead of copying them. Real kernels and real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import psutil
import pytest
import torch.distributed as dist

from conftest import Kernel, launch_processes, wait_gone
from nblaunch import notebook_launcher

pytestmark = pytest.mark.timeout(300)

OWN_MEMORY = """
import json, os, socket, psutil, torch, torch.distributed as dist, torch.multiprocessing as tmp
import logging, tqdm.auto, transformers.trainer, pytorch_lightning, accelerate
logging.basicConfig(level=logging.INFO)
from nblaunch import notebook_launcher

def own_memory(out):
    dist.barrier()
    uss = psutil.Process().memory_full_info().uss   # pages this rank alone holds
    dist.barrier()                                  # every rank measured before any leaves
    with open(os.path.join(out, str(dist.get_rank())), "w") as f:
        f.write(str(uss))

def torch_rank(i, n, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE=str(n))
    dist.init_process_group("gloo")
    own_memory(out)
    dist.destroy_process_group()

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def ranks_memory(launcher, out, n=3):
    os.makedirs(out)
    if launcher == "nblaunch":
        notebook_launcher(own_memory, args=(out,), num_processes=n, start_method="fork", display="none")
    else:
        tmp.start_processes(torch_rank, args=(n, free_port(), out), nprocs=n, start_method="fork")
    return sum(int(open(os.path.join(out, str(r))).read()) for r in range(n))
"""


def test_forked_ranks_own_memory_stays_within_a_fifth_of_torch_forks(tmp_path):
    """The issue's bound (bench/run.py holds the measured ratio): before the
    zygote, each forked rank copied about 2 MiB more of the kernel's pages
    than a torch.multiprocessing rank (1.3x), by becoming a rank on its own."""
    k = Kernel()
    try:
        reply = k.execute(OWN_MEMORY, timeout=180)
        assert reply.error is None, reply.error
        warm = k.execute("notebook_launcher(lambda: None, num_processes=3, display='none')")
        assert warm.error is None, warm.error
        seen: dict = {"nblaunch": [], "torch": []}
        for i in range(2):  # alternating, the smaller of two: one reading can catch a stray page burst
            for launcher in seen:
                reply = k.execute(f"print(ranks_memory({launcher!r}, {str(tmp_path / f'{launcher}{i}')!r}))")
                assert reply.error is None, reply.error
                seen[launcher].append(int(reply.stdout.split()[-1]))
        ours, theirs = min(seen["nblaunch"]), min(seen["torch"])
        assert ours <= 1.2 * theirs, f"ranks' own memory: nblaunch {ours / 2**20:.1f} MiB, torch fork {theirs / 2**20:.1f} MiB"
    finally:
        k.shutdown()


GC_COPY = """
import gc, os, psutil, torch.multiprocessing as tmp
from nblaunch import notebook_launcher
notebook_objects = [{"i": i, "s": str(i)} for i in range(400_000)]   # about 100 MiB of the kernel's heap

def copied_by_a_collection(i=0, out=None):
    before = psutil.Process().memory_full_info().uss
    gc.collect()
    grew = psutil.Process().memory_full_info().uss - before
    if out is None:
        return grew
    with open(os.path.join(out, str(i)), "w") as f:
        f.write(str(grew))

def torch_ranks(out, n=2):
    os.makedirs(out)
    tmp.start_processes(copied_by_a_collection, args=(out,), nprocs=n, start_method="fork")
    return [int(open(os.path.join(out, str(i))).read()) for i in range(n)]
"""


def test_a_full_collection_in_a_forked_rank_copies_none_of_the_kernels_heap(tmp_path):
    """A forked rank shares the kernel's objects until it writes to them, and
    a full collection writes to every object it visits. What the rank
    inherited is frozen (never collected in it), on both ways a rank is
    forked: by the kernel itself (its first small launch) and by a zygote.
    torch's forked ranks, in the same kernel, show what that saves."""
    k = Kernel()
    try:
        reply = k.execute(GC_COPY, timeout=180)
        assert reply.error is None, reply.error
        seen = {}
        for way, n in (("forked by the kernel", 2), ("forked by a zygote", 4)):
            reply = k.execute(f"print(notebook_launcher(copied_by_a_collection, num_processes={n}, "
                              "init_process_group=False, display='none'))")
            assert reply.error is None, reply.error
            seen[way] = max(int(x) for x in reply.stdout.strip().splitlines()[-1].strip("[]").split(","))
        reply = k.execute(f"print(max(torch_ranks({str(tmp_path / 'torch')!r})))")
        assert reply.error is None, reply.error
        seen["torch fork"] = int(reply.stdout.split()[-1])
        mib = {way: f"{grew / 2**20:.1f} MiB" for way, grew in seen.items()}
        assert seen["torch fork"] > 20 * 2**20, f"the heap a collection would copy is not there: {mib}"
        assert seen["forked by the kernel"] < 8 * 2**20 and seen["forked by a zygote"] < 8 * 2**20, mib
    finally:
        k.shutdown()


class _Unclearable(dict):
    def clear(self):
        raise RuntimeError("this state cannot be cleared")


def said_nothing():
    return dist.get_rank()


def test_a_shim_that_cannot_adapt_a_library_says_so_in_every_forked_ranks_output(monkeypatch, capsys):
    """What making the ranks ready writes is written once, in the zygote, and
    must still reach each rank's output (and so the cell), as when each rank
    made itself ready."""
    state = types.ModuleType("accelerate.state")
    state.AcceleratorState = type("AcceleratorState", (), {"_shared_state": _Unclearable(made_in="kernel")})
    monkeypatch.setitem(sys.modules, "accelerate.state", state)
    assert notebook_launcher(said_nothing, num_processes=2, start_method="fork") == [0, 1]
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert (f"[rank {rank}] [nblaunch] could not adapt accelerate.state for a rank: "
                "RuntimeError('this state cannot be cleared')") in out, out


def parents():
    import os

    return os.getppid()


def test_forked_ranks_share_one_parent_that_leaves_with_them():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    ppids = notebook_launcher(parents, num_processes=3, start_method="fork", display="none")
    assert len(set(ppids)) == 1 and ppids[0] != me.pid  # the zygote, not the kernel
    new = [p.pid for p in me.children(recursive=True) if p.pid not in before]
    assert wait_gone(new, timeout=5) == []


def test_jupyters_interrupt_as_the_zygote_is_forked_stops_the_launch_and_nothing_else():
    """The interrupt goes to the kernel's whole process group, which the
    zygote is in until it takes its own: there it raised KeyboardInterrupt
    in the zygote's start-up (a traceback in the cell), and writing that
    traceback could hang on a lock another kernel thread held at the fork,
    so the zygote outlived the launch (CI; 3 in 200 such interrupts here)."""
    script = os.path.join(os.path.dirname(__file__), "group_interrupt.py")
    done = subprocess.run([sys.executable, script, "20"], capture_output=True, text=True, timeout=240,
                          start_new_session=True)  # a group of its own, as a kernel has
    assert done.returncode == 0, done.stderr[-3000:]
    launches = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(launches) == 20
    for launch in launches:
        assert launch["raised"] == "KeyboardInterrupt", launch
        assert launch["took"] < 1.5 and launch["left"] == [], launch
        # It left on its own once its ranks were reaped (0), or was ended by the
        # stop while still making them (-9); never hung until its reap's kill.
        assert launch["zygote_exit"] in (0, -9) and launch["zygote_reap_s"] < 1.0, launch
        if launch["zygote_got_it"]:
            assert launch["zygote_held_it"], launch  # its handler never ran
    assert sum(launch["zygote_got_it"] for launch in launches) >= 5, "too few interrupts reached a zygote"
    assert "nblaunch-zygote" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def exit_after_print(code):
    print(f"leaving with {code}", flush=True)
    import os

    os._exit(code)


@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_ranks_exit_code_reaches_the_kernel_through_the_zygote(code):
    """The kernel cannot wait for its grandchildren: the zygote reaps each rank
    and passes its exit status on."""
    from nblaunch.errors import WorkerError

    with pytest.raises(WorkerError) as info:
        notebook_launcher(exit_after_print, args=(code,), num_processes=2, start_method="fork", display="none")
    assert f"code {code}" in str(info.value) and f"leaving with {code}" in str(info.value)


def peer_error_after_a_silent_death():
    """Rank 1 dies at once, its death unheard while the zygote is held
    (SIGSTOP); rank 0 then reports the lost peer, a consequence."""
    import os
    import signal
    import time

    if dist.get_rank() == 1:
        os.kill(os.getppid(), signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")


def test_a_rank_dead_but_not_yet_reaped_by_the_zygote_is_still_the_root_cause():
    """When the consequence's hold ends, nblaunch stops every rank still
    running and judges their deaths as its own doing. A rank that had
    already died, but whose exit the zygote had not passed on yet, was
    counted among them and its peer blamed (seen under load in the suite)."""
    import signal
    import threading

    from nblaunch.errors import WorkerError

    me = psutil.Process()
    done = threading.Event()

    def resume_held_zygotes() -> None:
        while not done.wait(0.05):
            for p in me.children(recursive=True):
                try:
                    if p.status() == psutil.STATUS_STOPPED and done.wait(1.0) is False:
                        p.send_signal(signal.SIGCONT)  # a second after the hold has ended
                except psutil.Error:
                    pass

    thread = threading.Thread(target=resume_held_zygotes, daemon=True)
    thread.start()
    try:
        with pytest.raises(WorkerError) as info:
            notebook_launcher(peer_error_after_a_silent_death, num_processes=2, start_method="fork", display="none")
    finally:
        done.set()
        thread.join()
    assert info.value.rank == 1 and info.value.root.kind == "signal", str(info.value)


def test_a_zygote_that_dies_before_forking_is_a_clear_launch_error(monkeypatch):
    """The zygote's death before its ranks exist (stood in for by an exit in
    its set-up: a failed fork is hard to make as root) fails the launch at
    once, saying so, and leaves no process or pipe behind."""
    import os
    import time

    from nblaunch import LaunchError
    from nblaunch.rank import setup as rank_setup

    monkeypatch.setattr(rank_setup, "prepare_for_ranks", lambda spec: os._exit(3))
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LaunchError, match=r"could not start local rank 0 \(it ended with code 3\)"):
        notebook_launcher(said_nothing, num_processes=2, start_method="fork", display="none")
    deadline = time.monotonic() + 10  # the zygote is reaped, and its pipe closed, just after the launch returns
    while len(os.listdir("/proc/self/fd")) > fds and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_the_stop_button_while_the_zygote_makes_the_ranks_returns_at_once(monkeypatch):
    """A zygote slow to make its ranks (a loaded machine: seconds) is ended,
    not waited for, and its ranks with it: a press then took 2 s more to
    return (the teardown's wait for the starter; 4 s once in the suite under
    load, tests/test_kernel.py's early stop-button test)."""
    import signal
    import threading
    import time

    from nblaunch.rank import setup as rank_setup

    prepare = rank_setup.prepare_for_ranks
    monkeypatch.setattr(rank_setup, "prepare_for_ranks", lambda spec: (time.sleep(3), prepare(spec))[1])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a kernel's, as ipykernel sets
    before = set(launch_processes(os.getpid()))
    pressed: dict = {}

    def press():
        time.sleep(0.5)  # the zygote is forked by then, and sleeps in its set-up
        pressed["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press)
    try:
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            notebook_launcher(said_nothing, num_processes=2, start_method="fork", display="none")
        took = time.monotonic() - pressed["at"]
    finally:
        presser.join()
        signal.signal(signal.SIGINT, previous)
    assert took < 1.0, f"the press took {took:.2f} s to return"
    assert wait_gone(set(launch_processes(os.getpid())) - before, timeout=5) == []
