"""The scripts' smoke tests: each script under ``scripts/`` runs with ``--smoke`` (tiny sizes on the
CPU), loaded by path with its ``main(argv)`` called in-process (``load_script``), or as a subprocess
where the script reads its mode at import (``run_script``): a script that no longer runs against
the package fails here, not on the GPU machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlkernel

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SRC = Path(rlkernel.__file__).resolve().parents[1]  # the package these tests import


def _run(name: str, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(SCRIPTS / f"{name}.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        pytest.fail(f"scripts/{name}.py exited {proc.returncode}:\n{tail}")
    return proc.stdout


@pytest.fixture
def run_script():
    """``run_script(name, *args)``: ``python scripts/<name>.py args...`` with this package first on
    the path; its stdout. Fails the test with the script's output if it exits non-zero."""
    return _run

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
