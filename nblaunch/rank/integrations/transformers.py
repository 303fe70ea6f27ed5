"""transformers in a rank: the console progress of a torchrun rank, and the
Trainer's logged numbers on the rank's row."""
from __future__ import annotations

__all__ = ["plain_trainer_progress", "forget_notebook_answer", "trainer_logs_to_rows"]


def plain_trainer_progress(module) -> None:
    """transformers picks ``NotebookProgressCallback`` (HTML through IPython's
    display) when ``transformers.trainer`` is imported in a notebook; a rank
    uses the console ``ProgressCallback``, as under torchrun."""
    from transformers.trainer_callback import ProgressCallback

    if getattr(module, "DEFAULT_PROGRESS_CALLBACK", ProgressCallback) is not ProgressCallback:
        module.DEFAULT_PROGRESS_CALLBACK = ProgressCallback


def forget_notebook_answer(module) -> None:
    """``transformers.utils.is_in_notebook`` caches its answer (lru_cache):
    the kernel's True would stay the rank's."""
    cached = getattr(module, "is_in_notebook", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def trainer_logs_to_rows(module) -> None:
    """The HF Trainer's console progress writes its logged numbers (loss,
    learning rate) as a printed dict; they also go to ``nblaunch.log`` so the
    rank's row and the chart show them."""
    cls = getattr(module, "ProgressCallback", None)
    if cls is None or getattr(cls.on_log, "_nblaunch", False):
        return
    original = cls.on_log

    def on_log(self, args, state, control, logs=None, **kwargs):
        from ..progress import log

        if logs:
            numbers = {k: v for k, v in logs.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "total_flos"}
            if numbers:
                log(step=state.global_step, **numbers)
        return original(self, args, state, control, logs=logs, **kwargs)

    on_log._nblaunch = True
    cls.on_log = on_log
