"""The layout rules (issues 36 and 50), checked on the source without a
process: a top level of doors, rooms that import each other one way only
and no module circle (every import counted: at module level, in functions,
under TYPE_CHECKING), no module too long to read in one sitting, no private
name used from another module, each engine's module short enough to copy
from, a session and call watch that never name an engine, and the kernel's
and agents' messages declared in ``wire/``."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nblaunch"
MAX_MODULE_LINES = 500
MAX_ENGINE_LINES = 320
MAX_TOP_LEVEL_MODULES = 12
ENGINE_MODULES = ["local", "elastic", "agent_engine", "slurm", "ray"]
ENGINE_NAMES = {"LocalEngine", "ElasticEngine", "AgentEngine", "SlurmEngine", "RayEngine", "LocalPool",
                "ElasticPool", "AgentPool", "SingleNode", "NodeGroup", "spans_nodes"}
# The rooms, lowest first, as docs/design.md draws them: a module imports
# only from its own room and the rooms before it. The top level's modules
# are rooms of one (the errors, the config, the session...); the doors
# (the public calls and the package itself) stand last.
ROOMS = ["system", "registry", "wire", "rank", "errors", "clusters", "outcome", "config", "engines", "view", "watch",
         "session", "background", "doors"]
DOORS = {"launcher", "live", "magic", "demo", "nblaunch", "__main__"}


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = (path, ast.parse(path.read_text(), str(path)))
    return found


MODULES = _modules()


def _package(name: str) -> str:
    path, _ = MODULES[name]
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _imports(name: str):
    """(imported module, names, node) of every import of the package's own
    modules, wherever it stands (module level, a function, TYPE_CHECKING)."""
    _, tree = MODULES[name]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nblaunch":
                    yield alias.name, [], node
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = _package(name).split(".")
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            yield ".".join(base + ([node.module] if node.module else [])), [a.name for a in node.names], node
        elif node.module and node.module.split(".")[0] == "nblaunch":
            yield node.module, [a.name for a in node.names], node


def _edges(name: str) -> set[str]:
    out = set()
    for target, names, _ in _imports(name):
        out |= {m for m in [target] + [f"{target}.{n}" for n in names] if m in MODULES and m != name}
    # Importing a module imports its package first; those edges are Python's, not a design's.
    return {m for m in out if MODULES[m][0].name != "__init__.py"}


def _room(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in DOORS:
        return "doors"
    return parts[1]


def test_the_top_level_holds_at_most_12_modules_and_every_room_is_drawn():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) + 1 <= MAX_TOP_LEVEL_MODULES, top
    rooms = {_room(m) for m in MODULES}
    assert rooms <= set(ROOMS), rooms - set(ROOMS)


def test_rooms_import_one_way():
    """Counted at the room: ``rank`` never imports ``engines``, ``config``
    never an engine, the watch never the session, and so on."""
    upward = []
    for name in MODULES:
        mine = ROOMS.index(_room(name))
        for target in _edges(name):
            if ROOMS.index(_room(target)) > mine:
                upward.append(f"{name} -> {target}")
    assert sorted(upward) == []


def test_the_kernel_and_the_agents_talk_in_types_declared_in_wire():
    """No tuple tagged with a string crosses the link; each side handles every message the other may send."""
    from nblaunch.wire import agent_messages as msg

    tagged, used = [], {}
    for name in ("nblaunch.engines.agent", "nblaunch.engines.agent_pool"):
        _, tree = MODULES[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("send", "_send", "_tell"):
                tagged += [f"{name}: {ast.unparse(a)}" for a in node.args if isinstance(a, ast.Tuple) and a.elts
                           and isinstance(a.elts[0], ast.Constant) and isinstance(a.elts[0].value, str)]
        used[name] = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == "msg"}
    assert tagged == []
    assert {t.__name__ for t in msg.TO_AGENT} <= used["nblaunch.engines.agent"]
    assert {t.__name__ for t in msg.TO_KERNEL} <= used["nblaunch.engines.agent_pool"]


def test_what_runs_in_this_kernel_is_kept_in_one_registry():
    """Module-level registries of runs, launches or live ranks live in ``registry`` only (``rank/`` runs in ranks)."""
    kept = []
    for name in (m for m in MODULES if not m.startswith("nblaunch.rank")):
        _, tree = MODULES[name]
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name != "nblaunch.registry":
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if any(k in n.lower() for n in names for k in ("runs", "inflight", "owners", "active", "one_at")):
                    kept.append(f"{name}: {names}")
    assert kept == []


def test_no_import_circle():
    graph = {m: _edges(m) for m in MODULES}
    state: dict[str, int] = {}
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_500_lines(name):
    path, _ = MODULES[name]
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES, path


@pytest.mark.parametrize("name", ENGINE_MODULES)
def test_each_engine_reads_in_one_sitting(name):
    path, _ = MODULES[f"nblaunch.engines.{name}"]
    assert len(path.read_text().splitlines()) <= MAX_ENGINE_LINES, path


def test_no_private_name_from_another_module():
    used = []
    for name in MODULES:
        _, tree = MODULES[name]
        aliases = {}
        for target, names, node in _imports(name):
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and target in MODULES:
                    used.append(f"{name}: from {target} import {alias.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")):
                used.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    assert used == []


@pytest.mark.parametrize("name", ["nblaunch.session", "nblaunch.watch.call", "nblaunch.watch.live",
                                  "nblaunch.watch.launch"])
def test_the_session_and_the_call_watch_never_name_an_engine(name):
    _, tree = MODULES[name]
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    named |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert named & ENGINE_NAMES == set()


def test_a_rank_pools_kind_fills_in_at_most_8_steps_and_the_verbs_are_written_once():
    from nblaunch.engines.agent_pool import AgentPool
    from nblaunch.engines.local_pool import LocalPool
    from nblaunch.engines.pool import RankPool

    assert len(RankPool.__abstractmethods__) <= 8, sorted(RankPool.__abstractmethods__)
    for kind in (LocalPool, AgentPool):
        assert {"stop", "close", "interrupt", "stacks", "collectives"}.isdisjoint(vars(kind)), kind


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_class_over_300_lines(name):
    _, tree = MODULES[name]
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300}
    assert long == {}


def test_every_public_name_is_where_the_lazy_map_says():
    import nblaunch

    assert set(nblaunch._LAZY) == set(nblaunch.__all__)
    for name, where in nblaunch._LAZY.items():
        assert getattr(nblaunch, name) is getattr(importlib.import_module(where, "nblaunch"), name), name


def test_a_node_agent_imports_no_kernel_side_module_and_its_ranks_still_find_every_name():
    """A node's agent (``python -m nblaunch.engines.agent``) starts without
    the launcher, the session or the views: its node's first step waits on
    that import. Its ranks' code still finds ``nblaunch.progress`` (the
    function, not the module of that name) and every other public name."""
    log = subprocess.run([sys.executable, "-X", "importtime", "-m", "nblaunch.engines.agent", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert log.returncode == 0 and "--node-var" in log.stdout, log.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in log.stderr.splitlines() if "|" in line}
    assert "nblaunch.engines" in imported
    assert not imported & {"nblaunch.launcher", "nblaunch.session", "nblaunch.view", "ipywidgets", "IPython"}
    as_agent = ("import sys; sys.orig_argv[1:] = ['-m', 'nblaunch.engines.agent']\n"
                "import nblaunch, nblaunch.rank.worker\n"
                "assert 'nblaunch.launcher' not in sys.modules\n"
                "assert callable(nblaunch.progress) and callable(nblaunch.runs), 'a submodule took a public name'\n"
                "print(sorted(n for n in nblaunch.__all__ if getattr(nblaunch, n) is None))")
    out = subprocess.run([sys.executable, "-c", as_agent], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
