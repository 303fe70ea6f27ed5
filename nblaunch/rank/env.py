"""What a rank looks like to the libraries it runs: a torchrun rank, not a notebook.

``become_rank`` is called once, early, from :func:`nblaunch.rank.worker.run_worker`,
whatever started the rank (for forked ranks on Linux, once for all of them,
by the zygote that forks them: :mod:`nblaunch.engines.zygote`). A forked rank is a
copy of the kernel: IPython's shell, ``sys.ps1``, the kernel's display and
exception hooks, logging handlers that write to the kernel's sockets, and
every answer a library worked out at import time ("am I in a notebook?")
come with it. Spawned and forkserver ranks start clean but inherit the wrong
multiprocessing start method and, under forkserver, the environment of the
moment the server started. This module
makes each of them what a torchrun rank on the same machine would see.

The contract, for every start method:

* no IPython shell: ``IPython.get_ipython()`` is None, no ``sys.ps1``, none
  of IPython's builtins, IPython's and ipykernel's singletons cleared;
* ``sys.displayhook``/``sys.excepthook`` are Python's defaults;
* logging handlers that wrote to the kernel's streams write to the rank's
  own fds 1/2 (under spawn/forkserver, the kernel's root logging set-up is
  recreated, since the notebook's ``basicConfig`` never ran there);
* the environment is the kernel's at launch time, less what ipykernel set
  only for its own front end (colour forcing, ``TERM=xterm-color``, the
  inline matplotlib backend, ``JPY_*``);
* ``multiprocessing``'s default start method is the platform's own (fork on
  Linux before Python 3.14), so DataLoader workers behave as under torchrun;
* libraries that decided "interactive" or "notebook" at import time in the
  kernel get the rank's answer (:mod:`nblaunch.rank.integrations`, each shim
  named and tested);
* thread pools the kernel made (``torch.compile``'s compile pool) work in a
  forked rank, which inherits them without their threads.
"""
from __future__ import annotations

import builtins
import logging
import multiprocessing
import os
import sys
import threading
from typing import Optional

from . import integrations

__all__ = ["become_rank", "kernel_logging", "rank_environ", "pg_timeout_for"]

DEFAULT_PG_TIMEOUT_S = 1800.0  # torch's own default for gloo
MAX_PG_TIMEOUT_S = 30 * 86400.0  # torch's socket deadlines overflow far beyond this (found by hypothesis)

# Set by ipykernel (zmqshell.init_environment, kernelapp) for its front end
# only: with them a rank's libraries colour text for a terminal that is not
# there, or draw plots for a front end that cannot receive them.
_KERNEL_ONLY_ENV = {
    "FORCE_COLOR": "1",
    "CLICOLOR_FORCE": "1",
    "CLICOLOR": "1",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}
_KERNEL_ONLY_PREFIXES = ("JPY_",)  # the kernel's parent pid, session name, interrupt event
_IPYTHON_BUILTINS = ("get_ipython", "__IPYTHON__", "display")


def rank_environ(environ: Optional[dict] = None) -> dict:
    """The kernel's environment as a rank should get it (see module doc)."""
    env = dict(os.environ if environ is None else environ)
    for name, value in _KERNEL_ONLY_ENV.items():
        if env.get(name) == value:
            del env[name]
    for name in [n for n in env if n.startswith(_KERNEL_ONLY_PREFIXES)]:
        del env[name]
    if env.get("TERM") == "xterm-color":  # ipykernel's; a rank writes to a pipe
        env["TERM"] = "dumb"
    return env


def kernel_logging() -> tuple:
    """The root logger's level and console handlers in this (kernel) process,
    as plain data a spawned rank can recreate: ``(level, ((stream, level,
    fmt, datefmt, style), ...))``. Handlers that write elsewhere (files,
    sockets) are the notebook's own business and are not copied."""
    root = logging.getLogger()
    handlers = []
    for h in root.handlers:
        name = _console_name(getattr(h, "stream", None)) if type(h) is logging.StreamHandler else None
        if name is None:
            continue
        fmt = h.formatter
        style = next((k for k, v in logging._STYLES.items() if fmt is not None and isinstance(fmt._style, v[0])), "%")
        handlers.append((name, h.level, fmt._fmt if fmt else None, fmt.datefmt if fmt else None, style))
    return root.level, tuple(handlers)


def become_rank(environ: dict, old_streams: tuple, logging_setup: tuple, forked: bool,
                kernel_facts: Optional[dict] = None) -> None:
    """Make this process look like a torchrun rank (module doc). ``environ``
    is :func:`rank_environ` of the kernel at launch time; ``old_streams`` are
    the ``sys.stdout``/``sys.stderr`` this process had before the worker
    pointed fds 1/2 at the kernel's pipe; ``logging_setup`` is
    :func:`kernel_logging` of the kernel, recreated when not ``forked``;
    ``kernel_facts``: :func:`kernel_facts` of the kernel just before a fork
    (what a forked rank would otherwise find by walking every module and
    logger it inherited, copying a page of the kernel's at each one)."""
    facts = kernel_facts or {}
    # Only what differs: a forked rank's environment is the kernel's less a
    # few variables, and rebuilding all of it (clear, then set each) cost
    # about 200 page copies per rank.
    for name in [name for name in os.environ if name not in environ]:
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    _leave_ipython()
    sys.displayhook = sys.__displayhook__
    sys.excepthook = sys.__excepthook__
    _repoint_logging(old_streams, facts.get("loggers"))
    if not forked:
        _recreate_logging(logging_setup)
    # The platform's default, as a torchrun rank gets: a spawned rank had
    # "spawn" fixed for it by multiprocessing's own start-up.
    multiprocessing.set_start_method(None, force=True)
    if forked:
        _revive_inherited_thread_pools()
    integrations.install(facts.get("interactive_modules"))


def kernel_facts() -> dict:
    """In the kernel, just before its ranks are forked: which loggers write
    to the kernel's streams, and which modules hold an import-time answer a
    rank must change. A forked rank then touches only those objects: a walk
    over everything it inherited costs each rank about 5 MiB of its own
    memory (the pages of every object it touches are copied)."""
    return {"loggers": tuple(name for name, logger in _loggers() if any(_kernel_stream(h) for h in logger.handlers)),
            "interactive_modules": integrations.interactive_modules()}


def _loggers():
    """``(name, logger)`` of the root logger ("") and every other."""
    yield "", logging.getLogger()
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            yield name, logger


def _kernel_stream(h) -> bool:
    """A console handler that writes to the kernel's streams (its
    ``sys.stdout``/``sys.stderr``, ipykernel's): in a rank they would reach
    the kernel's sockets, not the rank's pipe. (One on the kernel's own fds
    1/2 needs nothing: in a rank those are the pipe.)"""
    return (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and (h.stream in (sys.stdout, sys.stderr) or type(h.stream).__module__.startswith("ipykernel")))


# -- IPython -----------------------------------------------------------------------


def _leave_ipython() -> None:
    for attr in ("ps1", "ps2", "ps3"):
        if hasattr(sys, attr):
            delattr(sys, attr)
    shell_mod = sys.modules.get("IPython.core.interactiveshell")
    shell = getattr(shell_mod.InteractiveShell, "_instance", None) if shell_mod else None
    if shell is not None:
        trap = getattr(shell, "builtin_trap", None)
        if trap is not None:
            trap.deactivate()  # restores exit/quit, removes get_ipython
    for name in _IPYTHON_BUILTINS:
        builtins.__dict__.pop(name, None)
    # SingletonConfigurable.clear_instance on the concrete class clears every
    # class in its MRO (ZMQInteractiveShell, InteractiveShell, ...).
    app_mod = sys.modules.get("ipykernel.kernelapp")
    app = getattr(app_mod.IPKernelApp, "_instance", None) if app_mod else None
    kernel = getattr(app, "kernel", None)
    for singleton in (shell, app, kernel):
        if singleton is not None and hasattr(type(singleton), "clear_instance"):
            type(singleton).clear_instance()


# -- thread pools --------------------------------------------------------------------


def _revive_inherited_thread_pools() -> None:
    """A forked rank inherits every ``ThreadPoolExecutor`` of the kernel but
    none of their threads. Such an executor still counts its workers (and an
    idle one) and so starts none: every task waits for a thread that does
    not exist. ``torch.compile`` in the kernel leaves one (inductor's compile
    pool, ``AsyncCompile.pool()``, cached for the process; torch's own
    at-fork hook resets only its process pool), and a rank's first compile
    then waits forever in ``async_compile.wait``; torch's prefetch executor
    and a notebook's own executors are the same. Python has no at-fork reset
    for executors, so an executor whose workers are all gone gets new ones
    the first time the rank gives it work (checked per submit: a set of
    dead threads to look at, at most the pool's size)."""
    from concurrent.futures import thread as cf_thread

    cls = cf_thread.ThreadPoolExecutor
    adjust = getattr(cls, "_adjust_thread_count", None)
    if adjust is None or getattr(adjust, "_nblaunch", False):
        return

    def _adjust_thread_count(self):
        workers = getattr(self, "_threads", None)
        if workers and not any(t.is_alive() for t in workers):  # all the kernel's: not in this process
            workers.clear()
            if hasattr(self, "_idle_semaphore"):
                self._idle_semaphore = threading.Semaphore(0)
        return adjust(self)

    _adjust_thread_count._nblaunch = True
    cls._adjust_thread_count = _adjust_thread_count


# -- logging -----------------------------------------------------------------------


def _console_name(stream) -> Optional[str]:
    """``"stdout"``/``"stderr"`` for a stream that is one of this process's
    consoles (the kernel's ipykernel ``OutStream`` or the real ones)."""
    if stream is None:
        return None
    if stream in (sys.stdout, sys.__stdout__):
        return "stdout"
    if stream in (sys.stderr, sys.__stderr__):
        return "stderr"
    if type(stream).__module__.startswith("ipykernel"):
        name = getattr(stream, "name", "")
        return name if name in ("stdout", "stderr") else "stderr"
    return None


def _repoint_logging(old_streams: tuple, names: Optional[tuple] = None) -> None:
    """Handlers made in the kernel (``logging.basicConfig`` in a cell,
    transformers' own) hold the kernel's streams; a forked rank writing there
    would bypass its pipe. Each is pointed at the rank's own stream.
    ``names``: the loggers that have such handlers, as the kernel found them
    before forking (None: look at every logger)."""
    old_out, old_err = old_streams
    targets = {id(old_out): sys.stdout, id(old_err): sys.stderr}
    loggers = [lg for _, lg in _loggers()] if names is None else [logging.getLogger(name or None) for name in names]
    for logger in loggers:
        for h in logger.handlers:
            if not isinstance(h, logging.StreamHandler) or isinstance(h, logging.FileHandler):
                continue
            new = targets.get(id(h.stream))
            if new is None and type(h.stream).__module__.startswith("ipykernel"):
                new = sys.stdout if getattr(h.stream, "name", "") == "stdout" else sys.stderr
            if new is not None:
                # Assigned, not setStream(): that flushes the old stream, and
                # flushing ipykernel's stream in a forked child talks to the
                # kernel's sockets.
                h.stream = new


def _recreate_logging(setup: tuple) -> None:
    if not setup:
        return
    level, handlers = setup
    root = logging.getLogger()
    if root.handlers:
        return  # something in the rank configured logging already
    root.setLevel(level)
    for stream, h_level, fmt, datefmt, style in handlers:
        h = logging.StreamHandler(sys.stdout if stream == "stdout" else sys.stderr)
        h.setLevel(h_level)
        h.setFormatter(logging.Formatter(fmt, datefmt, style))
        root.addHandler(h)


def pg_timeout_for(timeout: Optional[float]) -> float:
    """Collectives give up a little after a launch (or call) would: its
    timeout then fires first and shows where every rank is, instead of
    gloo's error. Never sooner than torch's own default, though: the
    kernel's timeout stands still while a rank is paused in its debugger
    (:mod:`nblaunch.watch.debug_desk`), and its peers' collectives cannot be told."""
    if timeout is None:
        return DEFAULT_PG_TIMEOUT_S
    return min(max(float(timeout) + max(10.0, 0.1 * float(timeout)), DEFAULT_PG_TIMEOUT_S), MAX_PG_TIMEOUT_S)
