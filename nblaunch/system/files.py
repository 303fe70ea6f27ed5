"""The one atomic write: a file is seen whole or not at all."""
from __future__ import annotations

import os
import threading
from typing import Union

__all__ = ["write_atomically"]


def write_atomically(path: Union[str, os.PathLike], data: Union[bytes, str]) -> None:
    """``data`` at ``path``, written beside it and renamed over it: a reader
    sees the old file or the new one, never part of one. The temporary file
    is named for the writing process and thread, so two writers never share
    it (a rank and the kernel both write a preemption notice)."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(tmp, path)
