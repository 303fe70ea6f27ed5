"""How a launch, a call on live ranks or a background run ended: one
:class:`Outcome`, its status decided here once from the error (if any), for
the view's last line, ``Run.status`` and a detached run's folder alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import LaunchTimeout, Preempted, RunStopped

__all__ = ["Outcome", "STATUSES", "status_of"]

#: Every status an outcome can have; ``interrupted`` is the user's stop of a
#: launch or call in the cell, ``stopped`` a background run's ``run.stop()``.
STATUSES = ("finished", "failed", "stopped", "timed out", "interrupted", "preempted")


@dataclass(frozen=True)
class Outcome:
    """``status`` (one of :data:`STATUSES`) with the results, or the error."""

    status: str
    results: Any = None
    error: Optional[BaseException] = None

    @classmethod
    def finished(cls, results: Any) -> "Outcome":
        return cls("finished", results)

    @classmethod
    def of(cls, error: BaseException) -> "Outcome":
        """The outcome of a call or run that raised ``error``."""
        return cls(status_of(error), error=error)

    @property
    def ok(self) -> bool:
        return self.status == "finished"


def status_of(error: Optional[BaseException]) -> str:
    """The one place an error is mapped to a status."""
    if error is None:
        return "finished"
    if isinstance(error, RunStopped):
        return "stopped"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, LaunchTimeout):
        return "timed out"
    if isinstance(error, Preempted):
        return "preempted"
    return "failed"
