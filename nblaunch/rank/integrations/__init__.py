"""Shims for the libraries a rank runs, in one place.

Libraries that work out "am I in a notebook?" (or keep process state) at
import time give a forked rank the kernel's answer; progress bars draw where a
rank cannot. Each shim is named by the module it adapts, applied right after
that module is imported in the rank, or at once when a forked rank inherited
it imported (:func:`install`, called by :func:`nblaunch.rank.env.become_rank`).
A shim that fails says so on the rank's stderr and never breaks the rank.

- :mod:`.tqdm`: console bars become rows; notebook bars behave as console bars;
- :mod:`.rich`: ``rich.progress`` tasks become rows (Lightning's default bar);
- :mod:`.transformers`: the Trainer's console progress, its logs on the row;
- :mod:`.accelerate`: no ``AcceleratorState`` carried over from the kernel;
- Lightning's ``_IS_INTERACTIVE`` (below): its ``ddp`` strategy runs in a rank.
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, Optional

from . import accelerate, rich, tqdm, transformers

__all__ = ["install", "fix_import_time_answers", "apply_fix", "AFTER_IMPORT"]


def _mirror_tqdm(module) -> None:
    tqdm.mirror(module.tqdm)


def _mirror_rich(module) -> None:
    rich.mirror(module.Progress)


# Fixes applied to a module when it is imported in the rank, or at once if it
# already was (a forked rank). Keys are module names.
AFTER_IMPORT: dict[str, Callable] = {
    "tqdm.std": _mirror_tqdm,
    "tqdm.notebook": tqdm.detach_notebook,
    "rich.progress": _mirror_rich,
    "accelerate.state": accelerate.fresh_state,
    "transformers.utils.import_utils": transformers.forget_notebook_answer,
    "transformers.trainer": transformers.plain_trainer_progress,
    "transformers.trainer_callback": transformers.trainer_logs_to_rows,
}


def install(interactive_modules: Optional[tuple] = None) -> None:
    """Adapt what is imported already, and what will be. ``interactive_modules``:
    see :func:`fix_import_time_answers`."""
    fix_import_time_answers(interactive_modules)
    _AfterImport.install(AFTER_IMPORT)


_LIGHTNING = ("lightning", "pytorch_lightning")


def interactive_modules() -> tuple:
    """In the kernel, before forking: the modules that hold Lightning's
    import-time answer. Looked up here because a walk over every module in a
    forked rank touches each module object, and each touch copies a page the
    rank shared with the kernel (measured: 5 MiB of each rank's own memory)."""
    if not any(name in sys.modules for name in (*_LIGHTNING, "lightning_fabric")):  # the walk costs ~1 ms
        return ()
    return tuple(name for name, module in list(sys.modules.items())
                 if name.startswith(_LIGHTNING) and hasattr(module, "_IS_INTERACTIVE"))


def fix_import_time_answers(names: Optional[tuple] = None) -> None:
    """For modules a forked rank inherited already imported. ``names``: the
    modules with Lightning's answer, as the kernel found them before forking
    (None: look, walking every module)."""
    interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive)
    # Lightning: `_IS_INTERACTIVE = hasattr(sys, "ps1") or ...` at import,
    # copied by `from ... import` into several modules; with it True,
    # Trainer(strategy="ddp") refuses to run ("not compatible with an
    # interactive environment").
    for name in interactive_modules() if names is None else names:
        module = sys.modules.get(name)
        if module is not None:
            module._IS_INTERACTIVE = interactive
    for name, fix in AFTER_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            apply_fix(fix, module)


def apply_fix(fix: Callable, module) -> None:
    try:
        fix(module)
    except Exception as exc:  # a fix must never break the rank or the user's import
        print(f"[nblaunch] could not adapt {module.__name__} for a rank: {exc!r}", file=sys.stderr)


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
        apply_fix(self._fix, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)
