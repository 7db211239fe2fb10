"""scripts/ holds what a contributor runs, and nothing points at a script that is gone:

* every ``scripts/<name>`` that a page, the README, the performance log, the Makefile, a script, a
  test or a module of the package names exists (a removed script is cited as removed, by name
  without the ``scripts/`` path, or not at all); ``KNOWN_STALE`` lists references accepted for a
  while, and may only shrink;
* every Python script has a smoke test that names it (tests/scripts/, or beside the code it compares);
* every shell script parses (``bash -n``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
REFERENCE = re.compile(r"scripts/([A-Za-z0-9_]+\.(?:py|sh))")
# (file, script) pairs in code another change owns; the test fails when one is gone (fix, then delete).
KNOWN_STALE: set[tuple[str, str]] = set()


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "benchmarks" / "NOTES.md", ROOT / ".ci" / "run"]
    for folder, pattern in (("docs", "*.md"), ("scripts", "*"), ("tests", "*.py"), ("src", "*.py")):
        files += sorted((ROOT / folder).rglob(pattern))
    return [f for f in files if f.is_file()]


def test_every_referenced_script_exists():
    stale = set()
    for path in _sources():
        for name in REFERENCE.findall(path.read_text(errors="replace")):
            if not (SCRIPTS / name).exists():
                stale.add((path.relative_to(ROOT).as_posix(), name))
    assert stale - KNOWN_STALE == set(), "references to scripts that do not exist"
    assert KNOWN_STALE - stale == set(), "fixed: remove them from KNOWN_STALE"


def test_scripts_are_few_and_each_python_script_has_a_smoke_test():
    scripts = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file())
    assert len(scripts) <= 12, scripts
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for name in scripts:
        if name.endswith(".py"):
            stem = name.removesuffix(".py")
            assert f'"{stem}"' in tests or f"scripts/{name}" in tests, f"no test runs scripts/{name}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_shell_scripts_parse(name):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
