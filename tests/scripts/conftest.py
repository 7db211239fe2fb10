"""The scripts' smoke tests: each script under ``scripts/`` is loaded by path and its ``main(argv)``
run in-process with ``--smoke`` (tiny sizes on the CPU), so a script that no longer runs against
the package fails here, not on the GPU machine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def load_script():
    """``load_script(name)``: the module ``scripts/<name>.py`` (registered in ``sys.modules`` while
    the test runs: dataclasses resolve the script's annotations through it)."""
    loaded = []

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"scripts.{name}", SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        loaded.append(spec.name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
