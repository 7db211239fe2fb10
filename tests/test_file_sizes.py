"""House rules that keep the code base readable (issue 28): no module in ``src/`` over 600 lines (a
module that grows past it has more than one job: split it by job, as ``kernels/attention.py`` was),
and ``scripts/`` limited to what a contributor runs (at most 12 files; libraries live in the
package)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_SCRIPTS = 12


def test_no_module_over_600_lines():
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "src").rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {too_long}"


def test_scripts_stay_few():
    scripts = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.is_file())
    assert len(scripts) <= MAX_SCRIPTS, f"{len(scripts)} files in scripts/ (at most {MAX_SCRIPTS}): {scripts}"
