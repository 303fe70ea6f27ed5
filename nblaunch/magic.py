"""The ``%%nblaunch`` cell magic: run a cell's body on every rank.

    %load_ext nblaunch

    %%nblaunch -n 4 --start-method forkserver --timeout 600
    t = torch.ones(1) * rank          # `rank` and `world_size` are predefined
    dist.all_reduce(t)
    t.item()                          # the last expression of each rank -> a list

Names the body uses from the notebook come with it: all of the namespace
under fork (inherited), and under spawn/forkserver the names the body
mentions, by value with cloudpickle. Errors are exactly those of
``notebook_launcher``.
"""
from __future__ import annotations

import ast
import itertools
import linecache
import os

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .launcher import choose_start_method, notebook_launcher

__all__ = ["NBLaunchMagics", "load_ipython_extension"]

_counter = itertools.count(1)
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_ih", "_oh", "_dh"}


def run_cell_body(source: str, filename: str, names: dict):
    """In a rank: execute ``source`` with ``names`` as globals; return the
    value of its last expression (None if it ends with a statement)."""
    import torch.distributed as dist

    # Register the source so tracebacks from this rank show the cell's lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = dict(names)
    scope["rank"] = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    scope["world_size"] = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), scope)  # noqa: S102 - running the user's own cell is the point
    return eval(compile(last, filename, "eval"), scope) if last is not None else None  # noqa: S307


@magics_class
class NBLaunchMagics(Magics):
    @magic_arguments()
    @argument("-n", "--num-processes", type=int, default=2, help="number of ranks (default 2)")
    @argument("--start-method", default="auto", help="auto, fork, forkserver or spawn")
    @argument("--backend", default="auto", help="auto, gloo, nccl, ...")
    @argument("--timeout", type=float, default=None, help="seconds before the launch is stopped")
    @argument("--display", default="auto", help="auto, widget, text or none")
    @cell_magic
    def nblaunch(self, line: str, cell: str):
        """Run this cell on every rank; the result is the list of each rank's last expression."""
        opts = parse_argstring(self.nblaunch, line)
        user_ns = self.shell.user_ns
        method, _ = choose_start_method(opts.start_method)
        if method == "fork":
            names = {k: v for k, v in user_ns.items() if k not in _IPYTHON_NAMES}
        else:
            names = {k: user_ns[k] for k in _names_used(cell) if k in user_ns and k not in _IPYTHON_NAMES}
        filename = f"<nblaunch-cell-{next(_counter)}>"
        return notebook_launcher(
            run_cell_body, args=(cell, filename, names), num_processes=opts.num_processes,
            start_method=opts.start_method, backend=opts.backend, timeout=opts.timeout,
            display=opts.display)


def _names_used(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()  # the rank reports the syntax error with its traceback
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(NBLaunchMagics)
