"""Every public callable has at least one bad-input test (DESIGN.md, "Bad input").

The public callables are walked, not listed:

* everything in ``rlkernel.__all__``; for a class, its constructor and its public classmethods and
  staticmethods (``PolicyLossConfig`` and ``PolicyLossConfig.preset``);
* everything in ``rlkernel.invariant.__all__`` and ``rlkernel.distributed.__all__``
  (docs/api/distributed.md), and in the ``__all__`` of every integration,
  ``rlkernel.integrations.openrlhf``, ``rlkernel.integrations.trl`` and ``rlkernel.integrations.verl``
  (docs/integrations/; of a class that subclasses a framework's, only what rlkernel defines; the
  verl one imports verl, so it is walked where verl 0.9.1 is installed — always under ``CI`` — and
  its ``COVERED`` entries are not called stale where it is not);
* every subcommand of the ``rlkernel`` command, as ``"cli:<name>"``.

Coverage is declared by the bad-input test modules, ``tests/**/test_bad_input*.py``: each has a
module-level ``COVERED`` list of the callables (or ``"cli:<name>"`` strings) its cases exercise. This
test imports each of those modules under a name of its own (so it also works when run alone, and
never clashes with pytest's import of the same file; package-relative imports resolve through a
private copy of the package), unions their lists, and fails

* naming every public callable that no list covers (add a real case to a bad-input module and list
  the callable in its ``COVERED``), and
* naming every ``COVERED`` entry that is not a public callable (stale: renamed, removed, or never
  public), and every bad-input module without a ``COVERED`` list.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import rlkernel
import rlkernel.distributed
import rlkernel.integrations.openrlhf
import rlkernel.integrations.trl
import rlkernel.invariant
from rlkernel.cli import build_parser

TESTS = Path(__file__).resolve().parent
PATTERN = "test_bad_input*.py"
_PRIVATE = "_rk_bad_input_walk"  # prefix of the walker's own module names


def _key(obj: object) -> str:
    """A stable identity for a callable: ``module:qualname`` (bound classmethods compare by what
    they wrap; a fresh ``Cls.method`` attribute access is a new object each time)."""
    if isinstance(obj, str):
        return obj
    target = getattr(obj, "__func__", obj)  # a bound classmethod -> its function
    return f"{target.__module__}:{target.__qualname__}"


def _class_members(cls: type) -> dict[str, object]:
    out = {_key(cls): cls}
    for name, raw in inspect.getmembers_static(cls):
        if name.startswith("_") or not isinstance(raw, classmethod | staticmethod):
            continue
        if not raw.__func__.__module__.startswith("rlkernel."):  # inherited from a framework's class
            continue
        member = getattr(cls, name)
        out[_key(member)] = member
    return out


def _verl_integration() -> types.ModuleType | None:
    """``rlkernel.integrations.verl``, imported as tests/integrations/verl_env.py does (verl's package
    needs ray/tensordict at import), or ``None`` where verl 0.9.1 is not installed and not under CI."""
    from integrations import verl_env

    if verl_env.unavailable_reason() is not None and not verl_env.in_ci():
        return None
    return verl_env.import_verl("rlkernel.integrations.verl")[0]


def public_callables() -> dict[str, object]:
    """``key -> callable`` for every public callable (see the module docstring)."""
    found: dict[str, object] = {}
    modules = [rlkernel, rlkernel.invariant, rlkernel.distributed, rlkernel.integrations.openrlhf,
               rlkernel.integrations.trl]  # fmt: skip
    verl = _verl_integration()
    for module in modules + ([verl] if verl is not None else []):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found.update(_class_members(obj))
            elif callable(obj):
                found[_key(obj)] = obj
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name in action.choices:
                found[f"cli:{name}"] = f"rlkernel {name}"
    return found


def _package_alias(directory: Path) -> str | None:
    """Import ``directory`` (a package: it has ``__init__.py``) under a private name, so that the
    modules loaded from it can use package-relative imports; ``None`` for a plain directory."""
    if not (directory / "__init__.py").exists():
        return None
    rel = directory.relative_to(TESTS)
    name = ".".join([_PRIVATE, *rel.parts])
    if name not in sys.modules:
        parent = _package_alias(directory.parent) if directory.parent != TESTS else None
        if parent is None and _PRIVATE not in sys.modules:
            root = types.ModuleType(_PRIVATE)
            root.__path__ = []
            sys.modules[_PRIVATE] = root
        spec = importlib.util.spec_from_file_location(
            name, directory / "__init__.py", submodule_search_locations=[str(directory)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return name


def bad_input_modules() -> dict[Path, types.ModuleType]:
    """Every ``tests/**/test_bad_input*.py``, imported under a unique private name."""
    modules = {}
    for path in sorted(TESTS.rglob(PATTERN)):
        package = _package_alias(path.parent)
        stem = path.stem
        name = f"{package}.{stem}" if package else f"{_PRIVATE}_{stem}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        modules[path] = module
    return modules


def test_every_public_callable_has_a_bad_input_case():
    public = public_callables()
    assert "rlkernel.rl.config:PolicyLossConfig.preset" in public  # the walk sees classmethods
    assert "cli:consistency" in public  # ... and the CLI's subcommands
    assert "rlkernel.integrations.openrlhf:PolicyLoss" in public  # ... and the integrations
    assert "rlkernel.integrations.trl.trainer:RLKernelGRPOTrainer" in public
    modules = bad_input_modules()
    assert modules, f"no {PATTERN} under {TESTS}"

    problems = []
    covered: dict[str, list[str]] = {}
    for path, module in modules.items():
        where = str(path.relative_to(TESTS.parent))
        entries = getattr(module, "COVERED", None)
        if not isinstance(entries, list | tuple) or not entries:
            problems.append(f"{where}: no module-level COVERED list of the public callables it tests")
            continue
        for entry in entries:
            key = _key(entry)
            covered.setdefault(key, []).append(where)
            if key.startswith("rlkernel.integrations.verl") and _verl_integration() is None:
                continue  # verl is not installed here: its callables are not walked
            if key not in public:
                problems.append(f"{where}: COVERED entry {key!r} is not a public callable (stale?)")

    missing = sorted(set(public) - set(covered))
    problems += [
        f"{key}: no bad-input case (add one to a tests/**/{PATTERN} module and list it in its COVERED)"
        for key in missing
    ]
    assert not problems, "\n".join(problems)
