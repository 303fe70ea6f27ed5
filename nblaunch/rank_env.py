"""What a rank looks like to the libraries it runs: a torchrun rank, not a notebook.

``become_rank`` is called once, early, from :func:`nblaunch.worker.run_worker`,
whatever started the rank. A forked rank is a copy of the kernel: IPython's
shell, ``sys.ps1``, the kernel's display and exception hooks, logging handlers
that write to the kernel's sockets, and every answer a library worked out at
import time ("am I in a notebook?") come with it. Spawned and forkserver ranks
start clean but inherit the wrong multiprocessing start method and, under
forkserver, the environment of the moment the server started. This module
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
  kernel get the rank's answer (the shims below, each named and tested);
* thread pools the kernel made (``torch.compile``'s compile pool) work in a
  forked rank, which inherits them without their threads.
"""
from __future__ import annotations

import builtins
import importlib.abc
import logging
import multiprocessing
import os
import sys
import threading
from typing import Callable, Optional

__all__ = ["become_rank", "kernel_logging", "rank_environ"]

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


def become_rank(environ: dict, old_streams: tuple, logging_setup: tuple, forked: bool) -> None:
    """Make this process look like a torchrun rank (module doc). ``environ``
    is :func:`rank_environ` of the kernel at launch time; ``old_streams`` are
    the ``sys.stdout``/``sys.stderr`` this process had before the worker
    pointed fds 1/2 at the kernel's pipe; ``logging_setup`` is
    :func:`kernel_logging` of the kernel, recreated when not ``forked``."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    _leave_ipython()
    sys.displayhook = sys.__displayhook__
    sys.excepthook = sys.__excepthook__
    _repoint_logging(old_streams)
    if not forked:
        _recreate_logging(logging_setup)
    # The platform's default, as a torchrun rank gets: a spawned rank had
    # "spawn" fixed for it by multiprocessing's own start-up.
    multiprocessing.set_start_method(None, force=True)
    if forked:
        _revive_inherited_thread_pools()
    _fix_import_time_answers()
    _AfterImport.install(_AFTER_IMPORT)


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


def _repoint_logging(old_streams: tuple) -> None:
    """Handlers made in the kernel (``logging.basicConfig`` in a cell,
    transformers' own) hold the kernel's streams; a forked rank writing there
    would bypass its pipe. Each is pointed at the rank's own stream."""
    old_out, old_err = old_streams
    targets = {id(old_out): sys.stdout, id(old_err): sys.stderr}
    loggers = [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(lg, logging.Logger)]
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


# -- answers libraries worked out at import time -------------------------------------


def _fix_import_time_answers() -> None:
    """For modules a forked rank inherited already imported."""
    interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive)
    for name, module in list(sys.modules.items()):
        # Lightning: `_IS_INTERACTIVE = hasattr(sys, "ps1") or ...` at import,
        # copied by `from ... import` into several modules; with it True,
        # Trainer(strategy="ddp") refuses to run ("not compatible with an
        # interactive environment").
        if name.startswith(("lightning", "pytorch_lightning")) and hasattr(module, "_IS_INTERACTIVE"):
            module._IS_INTERACTIVE = interactive
    for name, fix in _AFTER_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            _apply_fix(fix, module)


def _apply_fix(fix: Callable, module) -> None:
    try:
        fix(module)
    except Exception as exc:  # a fix must never break the rank or the user's import
        print(f"[nblaunch] could not adapt {module.__name__} for a rank: {exc!r}", file=sys.stderr)


def _detach_tqdm_notebook(module) -> None:
    """tqdm's notebook front end draws ipywidgets through the kernel's comm
    channel, which a rank cannot reach (a forked rank's messages are dropped
    with "attempted to send message from fork"). ``tqdm.auto`` picked it at
    import in the kernel, and classes that subclass it (Lightning's ``Tqdm``)
    are bound for good, so rebinding names cannot reach them all: instead its
    overrides are removed from the class, and every notebook bar in this rank
    behaves as the core ``tqdm`` (whose bars then become the rank's rows)."""
    cls = getattr(module, "tqdm_notebook", None)
    if cls is None or cls.__dict__.get("_nblaunch_detached"):
        return
    for attr, value in list(cls.__dict__.items()):
        if callable(value) or isinstance(value, (property, staticmethod, classmethod)):
            if not attr.startswith("__") or attr in ("__init__", "__iter__", "__repr__"):
                delattr(cls, attr)
    cls._nblaunch_detached = True


def _plain_trainer_progress(module) -> None:
    """transformers picks ``NotebookProgressCallback`` (HTML through IPython's
    display) when ``transformers.trainer`` is imported in a notebook; a rank
    uses the console ``ProgressCallback``, as under torchrun."""
    from transformers.trainer_callback import ProgressCallback

    if getattr(module, "DEFAULT_PROGRESS_CALLBACK", ProgressCallback) is not ProgressCallback:
        module.DEFAULT_PROGRESS_CALLBACK = ProgressCallback


def _forget_notebook_answer(module) -> None:
    """``transformers.utils.is_in_notebook`` caches its answer (lru_cache):
    the kernel's True would stay the rank's."""
    cached = getattr(module, "is_in_notebook", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _trainer_logs_to_rows(module) -> None:
    """The HF Trainer's console progress writes its logged numbers (loss,
    learning rate) as a printed dict; they also go to ``nblaunch.log`` so the
    rank's row and the chart show them."""
    cls = getattr(module, "ProgressCallback", None)
    if cls is None or getattr(cls.on_log, "_nblaunch", False):
        return
    original = cls.on_log

    def on_log(self, args, state, control, logs=None, **kwargs):
        from .progress import log

        if logs:
            numbers = {k: v for k, v in logs.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "total_flos"}
            if numbers:
                log(step=state.global_step, **numbers)
        return original(self, args, state, control, logs=logs, **kwargs)

    on_log._nblaunch = True
    cls.on_log = on_log


def _mirror_tqdm(module) -> None:
    from .progress import mirror_tqdm

    mirror_tqdm(module.tqdm)


def _fresh_accelerate_state(module) -> None:
    """accelerate keeps its process state in class-level singletons. One made
    in the kernel (an ``Accelerator()`` or ``PartialState()`` in a cell: one
    process, index 0) would be every forked rank's, and every rank would
    think it is the main process. A rank starts with none, as under torchrun."""
    for name in ("AcceleratorState", "GradientState", "PartialState"):
        cls = getattr(module, name, None)
        if cls is not None and getattr(cls, "_shared_state", None):
            cls._shared_state.clear()


def _mirror_rich(module) -> None:
    from .progress import mirror_rich

    mirror_rich(module.Progress)


# Fixes applied to a module when it is imported in the rank, or at once if it
# already was (a forked rank). Keys are module names.
_AFTER_IMPORT: dict[str, Callable] = {
    "tqdm.std": _mirror_tqdm,
    "tqdm.notebook": _detach_tqdm_notebook,
    "rich.progress": _mirror_rich,
    "accelerate.state": _fresh_accelerate_state,
    "transformers.utils.import_utils": _forget_notebook_answer,
    "transformers.trainer": _plain_trainer_progress,
    "transformers.trainer_callback": _trainer_logs_to_rows,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run a fix right after a named module is first imported in this rank.

    Python has no post-import hook (PEP 369 was withdrawn); wrapt has one,
    but this rank needs it for a handful of module names, and a first meta-path
    finder that wraps the found loader is all it takes."""

    def __init__(self, fixes: dict[str, Callable]):
        self._fixes = dict(fixes)

    @classmethod
    def install(cls, fixes: dict[str, Callable]) -> None:
        pending = {name: fix for name, fix in fixes.items() if name not in sys.modules}
        if pending and not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls(pending))

    def find_spec(self, name, path=None, target=None):
        fix = self._fixes.get(name)
        if fix is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            del self._fixes[name]
            spec.loader = _FixingLoader(spec.loader, fix)
        return spec


class _FixingLoader(importlib.abc.Loader):
    def __init__(self, loader, fix: Callable):
        self._loader, self._fix = loader, fix

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _apply_fix(self._fix, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)
