"""The libc calls a rank, the zygote and the forkserver guard make, and
their constants: ``prctl`` (Linux's process controls), ``fflush`` and
``tgkill`` (a signal to one thread of a process; see :func:`signal_main_thread`).

Looked up once, in the kernel, when this module is imported (importing
``nblaunch`` does, through :mod:`nblaunch.rank.worker`): a forked rank then uses
them as they are, while making them anew ran ctypes' set-up in every rank
(page copies of the kernel's, ~0.2 MiB a rank). Each is None where there is
no libc (``prctl`` also where libc has none: not Linux). Imports nothing but
the standard library (never torch): the forkserver guard runs before torch.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Optional

__all__ = ["PR_SET_PDEATHSIG", "PR_SET_CHILD_SUBREAPER", "prctl", "fflush", "tgkill", "signal_main_thread"]

PR_SET_PDEATHSIG = 1  # prctl(PR_SET_PDEATHSIG, sig): sig once the thread that forked us ends
PR_SET_CHILD_SUBREAPER = 36  # prctl(PR_SET_CHILD_SUBREAPER, 1): orphaned descendants become our children


def _libc_calls() -> tuple:
    """``(prctl, fflush, tgkill)`` from libc; None for each it lacks (all
    where there is no libc; ``tgkill`` is Linux's alone)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        linux = sys.platform.startswith("linux")
        return getattr(libc, "prctl", None), libc.fflush, getattr(libc, "tgkill", None) if linux else None
    except (OSError, AttributeError):
        return None, None, None


prctl: Optional[Any]
fflush: Optional[Any]
tgkill: Optional[Any]
prctl, fflush, tgkill = _libc_calls()


def signal_main_thread(pid: int, sig: int) -> None:
    """``sig`` to the main thread of process ``pid`` (on Linux its thread id
    is its pid). A signal sent to the process goes to any thread not holding
    it, and Linux passes over the main thread while another signal is
    pending for it: a helper thread then takes a SIGINT meant to wake the
    main thread from a blocking call, which sleeps on. Elsewhere (or should
    ``tgkill`` fail) the process is signalled; ``ProcessLookupError`` if it
    is gone."""
    if tgkill is None or tgkill(pid, pid, int(sig)) != 0:
        os.kill(pid, sig)
