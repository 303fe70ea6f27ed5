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

With live ranks (``%nblaunch start -n 4``, ``%nblaunch stop``; see
:mod:`nblaunch.live`) each ``%%nblaunch`` cell runs on them instead, and
the names a cell binds stay in each rank for the next cells, as ipyparallel's
``%%px`` does. ``%nblaunch status`` says what is up.

``%%nblaunch --background`` returns at once: the cell's value is the
:class:`~nblaunch.background.in_kernel.Run` (``run = _``), its view in the cell
(``--detach``: a run that outlives the kernel, see :mod:`nblaunch.background.detached`).
"""
from __future__ import annotations

import ast
import itertools
import linecache
import os

from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .rank import namespace
from . import live as live_ranks
from .errors import LaunchError
from .rank.frames import register_cell
from .launcher import notebook_launcher
from .engines.plan import choose_start_method

__all__ = ["NBLaunchMagics", "load_ipython_extension"]

_counter = itertools.count(1)
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_ih", "_oh", "_dh"}


def run_cell(source: str, filename: str, names: dict):
    """In a rank: execute ``source`` with ``names`` as globals; return the
    value of its last expression (None if it ends with a statement). In a
    live rank, in the rank's own namespace, where the names the cell binds
    stay for the next cell."""
    from .rank.spec import current_spec

    if current_spec() is not None and current_spec().live:
        ns = namespace.current()
        ns.bring(names)
        return _exec_cell(source, filename, ns.names)
    return _exec_cell(source, filename, dict(names))


def _exec_cell(source: str, filename: str, scope: dict):
    import torch.distributed as dist

    # Register the source so tracebacks from this rank show the cell's lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
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
    """``%%nblaunch`` runs a cell on every rank; ``%nblaunch start|stop|status`` manages live ranks."""

    ranks = None  # the live ranks %nblaunch start made

    @magic_arguments()
    @argument("action", nargs="?", default=None, help="start, stop or status (line magic only)")
    @argument("-n", "--num-processes", type=int, default=None, help="number of ranks (default 2)")
    @argument("--start-method", default="auto", help="auto, fork, forkserver or spawn")
    @argument("--backend", default="auto", help="auto, gloo, nccl, ...")
    @argument("--timeout", type=float, default=None, help="seconds before the launch is stopped")
    @argument("--display", default="auto", help="auto, widget, text or none")
    @argument("--cluster", default=None, help="slurm: ranks on every node of the SLURM allocation")
    @argument("--nodes", type=int, default=1, help="with --cluster: how many of its nodes (default all)")
    @argument("--node-lost-after", type=float, default=None,
              help="seconds without a heartbeat before a node is lost (default NBLAUNCH_NODE_LOST_AFTER, else 10)")
    @argument("--background", action="store_true", help="return at once: the cell's value is the Run (nblaunch.submit)")
    @argument("--detach", action="store_true", help="with --background: a run that outlives the kernel")
    @line_cell_magic
    def nblaunch(self, line: str, cell=None):
        """Run this cell on every rank (on the live ranks if they are up); the result is the list of
        each rank's last expression. As a line magic: ``start -n N``, ``stop``, ``status``."""
        opts = parse_argstring(self.nblaunch, line)
        if cell is None:
            return self._line(opts)
        if opts.action is not None:
            raise LaunchError(f"%%nblaunch takes options only, not {opts.action!r}; "
                              "use the line magic %nblaunch start|stop|status")
        user_ns = self.shell.user_ns
        filename = f"<nblaunch-cell-{next(_counter)}>"
        # Tracebacks and stacks from the ranks name the body's lines as the
        # cell's own (`Cell In[8], line 3`; the body starts below `%%nblaunch`),
        # and the kernel can show their source.
        register_cell(filename, f"Cell In[{self._cell_number()}]", 1)
        linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
        live = live_ranks.active()
        if live is not None and opts.num_processes in (None, live.num_processes):
            names = {k: user_ns[k] for k in _names_used(cell) if k in user_ns and k not in _IPYTHON_NAMES}
            return live.run(run_cell, cell, filename, names, timeout=opts.timeout,
                            display=None if opts.display == "auto" else opts.display)
        if opts.background or opts.detach:  # its ranks never fork the kernel: the names it uses, pickled
            from .background.submit import submit

            names = {k: user_ns[k] for k in _names_used(cell) if k in user_ns and k not in _IPYTHON_NAMES}
            return submit(run_cell, args=(cell, filename, names), num_processes=opts.num_processes or 2,
                          start_method=opts.start_method, backend=opts.backend, timeout=opts.timeout,
                          display=opts.display, cluster=opts.cluster, num_nodes=opts.nodes, detach=opts.detach,
                          node_lost_after=opts.node_lost_after)
        method, _ = choose_start_method(opts.start_method)
        if method == "fork" and opts.cluster is None:  # inherited whole; elsewhere pickled
            names = {k: v for k, v in user_ns.items() if k not in _IPYTHON_NAMES}
        else:
            names = {k: user_ns[k] for k in _names_used(cell) if k in user_ns and k not in _IPYTHON_NAMES}
        return notebook_launcher(
            run_cell, args=(cell, filename, names), num_processes=opts.num_processes or 2,
            start_method=opts.start_method, backend=opts.backend, timeout=opts.timeout,
            display=opts.display, cluster=opts.cluster, num_nodes=opts.nodes, node_lost_after=opts.node_lost_after)

    def _cell_number(self) -> int:
        """This cell's ``In[N]``: the number IPython gave the code it ran last
        (``execution_count`` is already the next one while a cell runs)."""
        numbers = getattr(self.shell.compile, "_filename_map", {}).values()
        return max(numbers, default=self.shell.execution_count - 1)

    def _line(self, opts):
        if opts.action == "start":
            type(self).ranks = live_ranks.start(opts.num_processes or 2, start_method=opts.start_method,
                                                backend=opts.backend, display=opts.display, cluster=opts.cluster,
                                                num_nodes=opts.nodes, node_lost_after=opts.node_lost_after)
            print(f"nblaunch: {type(self).ranks.status}")
        elif opts.action == "stop":
            live = live_ranks.active()
            if live is not None:
                live.close()
            type(self).ranks = None
            print("nblaunch: live ranks closed" if live is not None else "nblaunch: no live ranks were up")
        elif opts.action == "status":
            live = live_ranks.active()
            print(f"nblaunch: {live.status}" if live is not None else "nblaunch: no live ranks are up")
        else:
            raise LaunchError(f"%nblaunch takes start, stop or status, got {opts.action!r}; "
                              "to run a cell on the ranks, use %%nblaunch")


def _names_used(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()  # the rank reports the syntax error with its traceback
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(NBLaunchMagics)
