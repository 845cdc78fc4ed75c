"""The import graph of ``breezert``, ``breezert_agent``, ``breezert_train`` and ``breezert_bench``
points one way (issue #12).

plugin -> runtime -> (sched | worker -> stages -> models -> layers/kernels; stages never import
the worker, which hands them ``stages.interface.StageWorker``), with the leaf modules
``errors``, ``constants`` and ``host_copy`` at the bottom; the training distribution
(``training/breezert_train``) and the benchmark harness (``bench/breezert_bench``, issue 32) sit
beside the plugin, above the runtime. Every module is parsed
(AST; nothing is imported) and every import statement counts: module level, function-local and
``if TYPE_CHECKING:`` alike, relative ones resolved. Asserts: no cycle, the runtime never imports
the plugin, and the layer rules below.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"breezert": REPO / "runtime" / "breezert", "breezert_agent": REPO / "breezert_agent",
            "breezert_train": REPO / "training" / "breezert_train",
            "breezert_bench": REPO / "bench" / "breezert_bench"}

# (importer prefix, forbidden import prefixes). A prefix ``p`` matches ``p`` and ``p.*``.
LAYER_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("breezert.sched", (
        "torch", "breezert.worker", "breezert.stages", "breezert.models", "breezert.layers",
        "breezert.kernels", "breezert.engine", "breezert.server",
    )),
    ("breezert.models", (
        "breezert.worker", "breezert.stages", "breezert.sched", "breezert.engine",
        "breezert.server", "breezert.async_engine",
    )),
    ("breezert.layers", (
        "breezert.models", "breezert.worker", "breezert.stages", "breezert.sched",
        "breezert.engine",
    )),
    ("breezert.kernels", (
        "breezert.models", "breezert.worker", "breezert.stages", "breezert.sched",
        "breezert.engine",
    )),
    # The runner hands the stages a ``StageWorker`` (issue 32): they import nothing of the worker.
    ("breezert.stages", ("breezert.worker", "breezert.engine", "breezert.server")),
    ("breezert.worker", ("breezert.engine", "breezert.async_engine", "breezert.server")),
    # Issue 32: the engine's typed surface is torch-free, and the server drives the engine only
    # through it (``EngineClient``), never the engine's internals.
    ("breezert.engine_client", (
        "torch", "breezert.engine", "breezert.async_engine", "breezert.worker",
        "breezert.stages", "breezert.models", "breezert.frontend", "breezert.server",
    )),
    ("breezert.server", (
        "torch", "breezert.engine", "breezert.async_engine", "breezert.worker",
        "breezert.stages", "breezert.models", "breezert.sched.scheduler", "breezert.frontend",
    )),
    # The training distribution (issue 19) and the benchmark harness (issue 32: the lab's tools,
    # outside the product) are never imported by the runtime or the plugin.
    ("breezert", ("breezert_train", "breezert_bench")),
    ("breezert_agent", ("breezert_train", "breezert_bench")),
    ("breezert_bench", ("breezert_train", "breezert_agent")),
)
LEAF_MODULES = ("breezert.errors", "breezert.constants", "breezert.host_copy")
"""They may import no ``breezert`` module but ``breezert.errors``."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    """A module of the graph where the import names one, else the imported dotted name."""
    where: str
    """``path:line`` of the import statement."""


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _module_files(packages: dict[str, Path]) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for top, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(module: str, path: Path, shown: str, modules: set[str]) -> list[Edge]:
    """Every import in the file, wherever it stands. ``from X import a`` is an edge to ``X.a``
    where that is a module, else to ``X``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        where = f"{shown}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            edges.extend(Edge(module, alias.name, where) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                edges.append(Edge(module, sub if sub in modules else target, where))
    return list(dict.fromkeys(edges))  # one edge per target and statement


def _graph(packages: dict[str, Path], base: Path = REPO) -> tuple[set[str], list[Edge]]:
    """The modules of ``packages`` and every import they make (paths shown from ``base``)."""
    files = _module_files(packages)
    edges: list[Edge] = []
    for module, path in files.items():
        edges.extend(_imports(module, path, path.relative_to(base).as_posix(), set(files)))
    return set(files), edges


def _shortest_cycle(start: str, out: dict[str, list[Edge]]) -> tuple[list[Edge] | None, set[str]]:
    """Breadth first from ``start``: the shortest cycle back to it (or None) and every module
    reachable from it."""
    came: dict[str, Edge] = {}
    back: Edge | None = None
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in out[node]:
            if edge.target == start:
                back = back or edge
            elif edge.target not in came:
                came[edge.target] = edge
                queue.append(edge.target)
    if back is None:
        return None, set(came)
    path = [back]
    while path[0].source != start:
        path.insert(0, came[path[0].source])
    return path, set(came) | {start}


def _cycles(modules: set[str], edges: list[Edge]) -> list[tuple[list[Edge], set[str]]]:
    """One shortest cycle per group of modules that import each other, with the group."""
    out: dict[str, list[Edge]] = {m: [] for m in modules}
    for edge in edges:
        if edge.target in modules:
            out[edge.source].append(edge)
    searched = {m: _shortest_cycle(m, out) for m in sorted(modules)}
    found, grouped = [], set()
    for module, (cycle, reach) in searched.items():
        if cycle is None or module in grouped:
            continue
        group = {m for m in reach if module in searched[m][1]}
        grouped |= group
        found.append((cycle, group))
    return found


def _format_cycle(cycle: list[Edge], group: set[str]) -> str:
    lines = [" -> ".join([cycle[0].source, *(edge.target for edge in cycle)])]
    lines += [f"      {e.source} -> {e.target} ({e.where})" for e in cycle]
    others = sorted(group - {e.source for e in cycle})
    if others:
        lines.append(f"      (these import each other too: {', '.join(others)})")
    return "\n".join(lines)


def _plugin_imports(edges: list[Edge]) -> list[str]:
    return sorted(
        f"{e.where}: {e.source} -> {e.target}" for e in edges
        if _matches(e.source, "breezert") and _matches(e.target, "breezert_agent")
    )


def _layer_violations(edges: list[Edge]) -> list[str]:
    found = set()
    for edge in edges:
        for importer, forbidden in LAYER_RULES:
            if not _matches(edge.source, importer):
                continue
            for prefix in forbidden:
                if _matches(edge.target, prefix):
                    found.add(f"{edge.where}: {edge.source} -> {edge.target} "
                              f"({importer} must not import {prefix})")
        if (edge.source in LEAF_MODULES and _matches(edge.target, "breezert")
                and not _matches(edge.target, "breezert.errors")):
            found.add(f"{edge.where}: leaf module {edge.source} imports {edge.target}")
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> tuple[set[str], list[Edge]]:
    return _graph(PACKAGES)


def test_the_graph_has_no_cycle(graph: tuple[set[str], list[Edge]]) -> None:
    cycles = _cycles(*graph)
    assert not cycles, "import cycles:\n" + "\n".join(f"  {_format_cycle(*c)}" for c in cycles)


def test_the_runtime_never_imports_the_plugin(graph: tuple[set[str], list[Edge]]) -> None:
    bad = _plugin_imports(graph[1])
    assert not bad, "runtime modules import breezert_agent:\n  " + "\n  ".join(bad)


def test_layer_rules(graph: tuple[set[str], list[Edge]]) -> None:
    bad = _layer_violations(graph[1])
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


def test_every_rule_names_modules_that_exist(graph: tuple[set[str], list[Edge]]) -> None:
    modules = graph[0]
    named = [importer for importer, _ in LAYER_RULES] + list(LEAF_MODULES)
    named += [p for _, forbidden in LAYER_RULES for p in forbidden if p != "torch"]
    missing = [p for p in named if not any(_matches(m, p) for m in modules)]
    assert not missing, f"rules name no module of the tree: {missing}"


# ------------------------------------------------------------- the checker itself
def _tree(root: Path, files: dict[str, str]) -> tuple[set[str], list[Edge]]:
    """A small ``breezert`` + ``breezert_agent`` tree under ``root`` and its graph."""
    skeleton = {"breezert/__init__.py": "", "breezert/errors.py": "",
                "breezert/sched/__init__.py": "", "breezert_agent/__init__.py": ""}
    for rel, text in {**skeleton, **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return _graph({"breezert": root / "breezert", "breezert_agent": root / "breezert_agent"},
                  root)


def test_checker_sees_local_type_checking_and_relative_imports(tmp_path: Path) -> None:
    modules, edges = _tree(tmp_path, {
        "breezert/constants.py": "from breezert import errors\n",
        "breezert/sched/plan.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ..worker.runner import Runner\n"
        ),
        "breezert/worker/__init__.py": "",
        "breezert/worker/runner.py": "def f():\n    from . import warm\n    import torch\n",
        "breezert/worker/warm.py": "from .runner import f\nfrom breezert_agent.audio import x\n",
        "breezert_agent/audio.py": "",
        "breezert_agent/tts.py": "import breezert.sched.plan\n",
    })
    pairs = {(e.source, e.target) for e in edges}
    assert {
        ("breezert.constants", "breezert.errors"),
        ("breezert.sched.plan", "breezert.worker.runner"),
        ("breezert.worker.runner", "breezert.worker.warm"),
        ("breezert.worker.runner", "torch"),
        ("breezert.worker.warm", "breezert_agent.audio"),
        ("breezert_agent.tts", "breezert.sched.plan"),
    } <= pairs
    cycles = _cycles(modules, edges)
    assert len(cycles) == 1
    assert _format_cycle(*cycles[0]).startswith(
        "breezert.worker.runner -> breezert.worker.warm -> breezert.worker.runner\n"
        "      breezert.worker.runner -> breezert.worker.warm (breezert/worker/runner.py:2)"
    )
    assert _plugin_imports(edges) == [
        "breezert/worker/warm.py:2: breezert.worker.warm -> breezert_agent.audio"
    ]
    assert _layer_violations(edges) == [(
        "breezert/sched/plan.py:3: breezert.sched.plan -> breezert.worker.runner "
        "(breezert.sched must not import breezert.worker)"
    )]


def test_checker_flags_a_leaf_that_imports_upward(tmp_path: Path) -> None:
    modules, edges = _tree(tmp_path, {
        "breezert/constants.py": "def f():\n    from breezert.sched import plan\n",
        "breezert/sched/plan.py": "from breezert.constants import X\n",
    })
    assert _layer_violations(edges) == [
        "breezert/constants.py:2: leaf module breezert.constants imports breezert.sched.plan"
    ]
    ((cycle, group),) = _cycles(modules, edges)
    assert [e.source for e in cycle] == ["breezert.constants", "breezert.sched.plan"]
    assert group == {"breezert.constants", "breezert.sched.plan"}


def test_checker_flags_the_runtime_or_plugin_importing_training(tmp_path: Path) -> None:
    _, edges = _tree(tmp_path, {
        "breezert/cli.py": "def f():\n    from breezert_train.pipeline import main\n",
        "breezert_agent/tts.py": "import breezert_train\n",
    })
    assert _layer_violations(edges) == [
        "breezert/cli.py:2: breezert.cli -> breezert_train.pipeline "
        "(breezert must not import breezert_train)",
        "breezert_agent/tts.py:1: breezert_agent.tts -> breezert_train "
        "(breezert_agent must not import breezert_train)",
    ]


def test_checker_flags_the_runtime_or_plugin_importing_the_benchmark(tmp_path: Path) -> None:
    _, edges = _tree(tmp_path, {
        "breezert/cli.py": "def f():\n    from breezert_bench.runner import run_benchmark\n",
        "breezert_agent/tts.py": "from breezert_bench import ports\n",
    })
    assert _layer_violations(edges) == [
        "breezert/cli.py:2: breezert.cli -> breezert_bench.runner "
        "(breezert must not import breezert_bench)",
        "breezert_agent/tts.py:1: breezert_agent.tts -> breezert_bench "
        "(breezert_agent must not import breezert_bench)",
    ]
