"""The package's import graph keeps its layers: ``rl -> ops -> kernels | reference``, no cycles.

Every ``import`` statement of ``src/rlkernel`` is parsed, the ones inside functions included (that
is where back-edges hide), and resolved to the module it names. The rules (DESIGN.md, issue 11):

* ``kernels/`` and ``reference/`` import nothing from ``ops``, ``rl``, ``invariant``,
  ``distributed``, ``bench``, ``demo``, the CLI or the package root (``rlkernel`` itself); the
  private root helpers (``_dispatch``, ``_validate``, ``_autocast``) are below every layer.
* ``ops/`` imports nothing from ``rl`` or ``distributed`` (nor from the layers above it): the
  vocab-parallel op, its cross-rank checks and its autograd Function are in ``ops``;
  ``rlkernel.distributed`` is the public namespace above it (it re-exports the op and holds
  ``global_normalizers``).
* ``distributed`` imports nothing from ``rl``, ``invariant``, ``bench``, ``demo``, the CLI or the
  package root.
* ``rl/`` imports nothing from ``invariant``, ``bench``, ``demo`` or the CLI.
* ``integrations`` is the top layer: nothing else in ``src/`` (the package root and the tools
  included) imports it, and it imports none of the tools (``cli``, ``bench``, ``demo``).
* No import cycle between modules anywhere in ``src/``.

``KNOWN_*`` may list violations accepted for a while (empty now); the test fails on any violation
not listed, naming it, and also on a listed one that no longer exists, so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "rlkernel"

FORBIDDEN = {
    "kernels": {"ops", "rl", "invariant", "distributed", "bench", "demo", "cli", "<root>"},
    "reference": {"ops", "rl", "invariant", "distributed", "bench", "demo", "cli", "<root>"},
    "ops": {"rl", "distributed", "invariant", "bench", "demo", "cli", "<root>"},
    "distributed": {"rl", "invariant", "bench", "demo", "cli", "<root>"},
    "rl": {"invariant", "bench", "demo", "cli", "<root>"},
    "integrations": {"bench", "demo", "cli"},
}
# The top layer: no module outside it may import it (a rule for every layer, the root included).
TOP = "integrations"
KNOWN_BACK_EDGES: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _targets(name: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative import
            package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for target in names:
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            continue
        while target not in mods and "." in target:
            target = target.rsplit(".", 1)[0]
        out.append(target)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in _targets(name, path, node, mods) if t != name)
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "<root>"
    return "cli" if parts[1] == "cli" else parts[1]


def back_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if _layer(b) in FORBIDDEN.get(_layer(a), set()) or (_layer(b) == TOP and _layer(a) != TOP)
    }


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    counter = 0
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_no_import_goes_up_a_layer():
    edges = back_edges(import_graph())
    new = sorted(edges - KNOWN_BACK_EDGES)
    assert not new, "imports against the layering (rl -> ops -> kernels | reference):\n" + "\n".join(
        f"  {a} imports {b}" for a, b in new
    )
    gone = sorted(KNOWN_BACK_EDGES - edges)
    assert not gone, f"fixed, remove from KNOWN_BACK_EDGES: {gone}"


def test_no_import_cycles():
    found = cycles(import_graph())
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(f"  {' <-> '.join(c)}" for c in new)
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not gone, f"fixed, remove from KNOWN_CYCLES: {gone}"


def test_the_checks_see_what_they_must():
    """The scanner is not blind: a synthetic back-edge and a synthetic cycle are reported, and the
    real graph has the package's layers in it."""
    graph = {
        "rlkernel.kernels.a": {"rlkernel.rl.b"},
        "rlkernel.rl.b": {"rlkernel.ops.c"},
        "rlkernel.ops.c": {"rlkernel.rl.b"},
    }
    assert back_edges(graph) == {("rlkernel.kernels.a", "rlkernel.rl.b"), ("rlkernel.ops.c", "rlkernel.rl.b")}
    assert cycles(graph) == {frozenset({"rlkernel.rl.b", "rlkernel.ops.c"})}
    # nothing imports the top layer: not the root, not a tool, not a private helper
    upward = {
        name: {"rlkernel.integrations.x"} for name in ("rlkernel", "rlkernel.cli", "rlkernel._validate")
    }
    assert back_edges(upward) == {(name, "rlkernel.integrations.x") for name in upward}
    real = import_graph()
    assert "rlkernel.kernels.matmul" in real["rlkernel.invariant.matmul"] or any(
        t.startswith("rlkernel.kernels") for t in real["rlkernel.invariant.matmul"]
    )
    # function-local imports count (rl.fused imports ops inside functions as well)
    assert any(_layer(t) == "ops" for t in real["rlkernel.rl.fused"])
    # the tp_group route of linear_token_logprobs stays inside ops (a function-local import)
    assert "rlkernel.ops.vocab_parallel" in real["rlkernel.ops.logprobs"]
    # the integrations sit on the objectives
    assert any(_layer(t) == "rl" for t in real["rlkernel.integrations.openrlhf"])
