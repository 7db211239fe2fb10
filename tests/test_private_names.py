"""Private means private (issue 11): no ``_name`` crosses a package boundary inside ``src/rlkernel``.

A module of one package (``kernels``, ``ops``, ``rl``, …; the root modules form the package
``<root>``) may not import a ``_name`` from a module of another package, nor read ``mod._name`` of a
module it imported from another package. What one package offers another is a public name; a
private module (``rlkernel._dispatch``, ``kernels/_launch.py``) is fine to import as a module, its
public names are its interface within the library.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _is_package(module: str) -> bool:
    return (SRC.joinpath(*module.split(".")) / "__init__.py").exists()


def _package(module: str) -> str:
    """The package a module belongs to: ``rlkernel.ops.x`` and ``rlkernel.ops`` -> ``ops``."""
    parts = module.split(".")
    if _is_package(module):
        return parts[1] if len(parts) > 1 else "<root>"
    return parts[1] if len(parts) > 2 else "<root>"


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def scan(module: str, source: str) -> list[str]:
    """The private names ``source`` (the text of ``module``) takes from other packages."""
    here = _package(module)
    tree = ast.parse(source)
    found, modules = [], {}  # modules: local name -> the rlkernel module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlkernel"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_module(full):
                    modules[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and _package(node.module) != here:
                    found.append(f"{module}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rlkernel.") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _package(modules[node.value.id]) != here
        ):
            found.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr} ({modules[node.value.id]})")
    return found


def test_no_private_name_crosses_a_package():
    bad = []
    for path in sorted((SRC / "rlkernel").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        bad += scan(module, path.read_text())
    assert not bad, "make these names public in their module (or move the code):\n" + "\n".join(bad)


def test_the_scan_catches_both_forms_and_allows_same_package():
    crossing = (
        "from rlkernel.kernels.logprobs import _block\n"
        "from rlkernel.kernels import logprobs as k\n"
        "k._block(1, 2)\n"
    )
    assert len(scan("rlkernel.ops.logprobs", crossing)) == 2
    assert scan("rlkernel.kernels.matmul", crossing) == []  # the same package
    assert scan("rlkernel.rl.fused", "from rlkernel import _dispatch\n_dispatch.resolve_backend\n") == []
