"""The notebook's own modules, for ranks on other machines.

cloudpickle sends a function defined in the notebook by value, but one from
a module by reference: the rank imports the module. A module the notebook
imports from its own folder (``from model import Net``), or from a folder it
put on ``sys.path``, is usually not importable on a cluster node (Ray nodes
share no file system; the node's agent starts in another directory). The
kernel sends the source of every such pure-Python module with the launch,
and a node's agent installs those it cannot import itself into a folder of
the launch that it puts first on its ranks' path. What the node can import
(a shared file system, an installed package) is left as it is, so a module
is never imported twice under two identities.

Written here rather than taken from Ray (``runtime_env``'s ``working_dir``
and ``py_modules`` do this for Ray tasks, by uploading folders to the
cluster's store) because the same must work under SLURM, and only the
modules the notebook actually imported are sent, not whole folders.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

__all__ = ["local_sources", "install"]

MAX_BYTES = 8 << 20  # more source than this is not sent (a folder of data by mistake?)


def _system_dirs() -> list[str]:
    """Python's and the environment's folders, as given and as resolved."""
    paths = sysconfig.get_paths()
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, paths.get("stdlib", ""), paths.get("purelib", ""),
            paths.get("platlib", "")} - {""}
    return sorted(dirs | {os.path.realpath(d) for d in dirs})


def local_sources(limit: int = MAX_BYTES) -> dict[str, str]:
    """``relative path -> source`` of the pure-Python modules this process
    imported from a folder on ``sys.path`` that is not Python's or an
    installation's (the notebook's folder first of all)."""
    system = _system_dirs()
    roots = []
    for entry in sys.path:
        root = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(root) and not any(root == s or root.startswith(s + os.sep) for s in system) \
                and "site-packages" not in root and "dist-packages" not in root:
            roots.append(root)
    found: dict[str, str] = {}
    total = 0
    inside_system = tuple(d + os.sep for d in system)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py") or name == "__main__" or name.startswith("nblaunch"):
            continue
        if file.startswith(inside_system):
            continue  # most modules: said without resolving the path (30 ms a launch for a thousand)
        path = os.path.realpath(file)
        root = next((r for r in roots if path.startswith(r + os.sep)), None)
        if root is None or any(path.startswith(d + os.sep) for d in system):
            continue  # not on a root of ours, or inside Python or an environment (a venv in the notebook's folder)
        rel = os.path.relpath(path, root)
        parts = Path(rel).with_suffix("").parts
        if rel in found or not all(p.isidentifier() for p in parts):
            continue  # not importable by this name from this root
        try:
            source = Path(path).read_text()
        except (OSError, UnicodeDecodeError):
            continue
        total += len(source)
        if total > limit:
            break
        found[rel] = source
    return found


def install(sources: dict[str, str], folder: Path) -> list[str]:
    """On a node: write the modules it cannot import into ``folder`` and put
    that first on this process's path (and its children's). Returns the top
    names installed."""
    missing = {}
    for rel, source in sources.items():
        top = Path(rel).with_suffix("").parts[0]
        if top in missing or importlib.util.find_spec(top) is None:
            missing.setdefault(top, []).append((rel, source))
    for top, files in missing.items():
        for rel, source in files:
            dest = folder / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(source)
    if missing:
        sys.path.insert(0, str(folder))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
        importlib.invalidate_caches()
    return sorted(missing)
