"""rich in a rank: the tasks of a ``rich.progress.Progress`` become the rank's rows."""
from __future__ import annotations

import sys
import weakref
from typing import Optional

from .. import progress  # the module: its reporter() is asked at each call

__all__ = ["mirror"]


class _RichRow:
    """One task of a ``rich.progress.Progress`` as the reporter sees it (a ``progress.Row``)."""

    def __init__(self, owner, task_id):
        self._owner = weakref.ref(owner)
        self._task_id = task_id

    def state(self) -> Optional[tuple]:
        owner = self._owner()
        task = owner._tasks.get(self._task_id) if owner is not None else None
        if task is None:
            return None
        closed = owner.__dict__.get("_nblaunch_stopped", False)
        return _plain(task.description), task.completed, task.total, closed, "", None


def _plain(markup: str) -> str:
    """A rich description without its markup (``[bold]Epoch 1[/]``)."""
    try:
        from rich.text import Text

        return Text.from_markup(str(markup)).plain
    except Exception:
        return str(markup)


def mirror(progress_cls) -> None:
    """Make every visible task of a ``rich.progress.Progress`` that draws on
    the rank's console a row (Lightning's default progress bar where rich is
    installed). rich renders nothing live when its console is a pipe, which
    a rank's is; its final render at ``stop()`` is kept."""
    if progress_cls.__dict__.get("_nblaunch_mirrored"):
        return
    add_task, start, stop = progress_cls.add_task, progress_cls.start, progress_cls.stop

    def add_task_(self, *args, **kwargs):
        task_id = add_task(self, *args, **kwargs)
        reporter = progress.reporter()
        if (reporter is not None and kwargs.get("visible", True) and not self.disable
                and getattr(self.console, "file", None) in (sys.stdout, sys.stderr)):
            reporter.add(_RichRow(self, task_id))
        return task_id

    def start_(self):
        self.__dict__["_nblaunch_stopped"] = False
        return start(self)

    def stop_(self):
        self.__dict__["_nblaunch_stopped"] = True
        reporter = progress.reporter()
        if reporter is not None:
            reporter.flush()  # before the tasks it holds are gone
        return stop(self)

    progress_cls.add_task, progress_cls.start, progress_cls.stop = add_task_, start_, stop_
    progress_cls._nblaunch_mirrored = True
