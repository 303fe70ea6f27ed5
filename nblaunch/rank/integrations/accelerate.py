"""accelerate in a rank: no process state carried over from the kernel."""
from __future__ import annotations

__all__ = ["fresh_state"]


def fresh_state(module) -> None:
    """accelerate keeps its process state in class-level singletons. One made
    in the kernel (an ``Accelerator()`` or ``PartialState()`` in a cell: one
    process, index 0) would be every forked rank's, and every rank would
    think it is the main process. A rank starts with none, as under torchrun."""
    for name in ("AcceleratorState", "GradientState", "PartialState"):
        cls = getattr(module, name, None)
        if cls is not None and getattr(cls, "_shared_state", None):
            cls._shared_state.clear()
