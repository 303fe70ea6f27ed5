"""The libc calls a rank, the zygote and the forkserver guard make, and
their constants: ``prctl`` (Linux's process controls) and ``fflush``.

Looked up once, in the kernel, when this module is imported (importing
``nblaunch`` does, through :mod:`nblaunch.rank.worker`): a forked rank then uses
them as they are, while making them anew ran ctypes' set-up in every rank
(page copies of the kernel's, ~0.2 MiB a rank). Each is None where there is
no libc (``prctl`` also where libc has none: not Linux). Imports nothing but
the standard library (never torch): the forkserver guard runs before torch.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

__all__ = ["PR_SET_PDEATHSIG", "PR_SET_CHILD_SUBREAPER", "prctl", "fflush"]

PR_SET_PDEATHSIG = 1  # prctl(PR_SET_PDEATHSIG, sig): sig once the thread that forked us ends
PR_SET_CHILD_SUBREAPER = 36  # prctl(PR_SET_CHILD_SUBREAPER, 1): orphaned descendants become our children


def _libc_calls() -> tuple:
    """``(prctl, fflush)`` from libc; ``(None, None)`` where there is no libc."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return getattr(libc, "prctl", None), libc.fflush
    except (OSError, AttributeError):
        return None, None


prctl: Optional[Any]
fflush: Optional[Any]
prctl, fflush = _libc_calls()
