"""Tests set rlkernel's switches through ``rk.use_options`` (or the ``set_options`` fixture), never by
assigning module attributes (issue 11). What ``monkeypatch.setattr`` remains replaces a function with
a spy or stub, or fakes a fact about the machine (a GPU model, a Triton without TMA), or shrinks a
reference's test size; each such line (or the line above it) says so with a ``# seam`` comment, and
no test may patch an attribute named like an :class:`rlkernel.Options` field's old module global."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import rlkernel as rk

TESTS = Path(__file__).resolve().parent
# The module globals the options replaced (issue 11): none may come back as a patched attribute.
FORMER_GLOBALS = (
    "MODE",
    "NARROW_N",
    "VOCAB_N",
    "MIN_TILES",
    "MIN_TILES_TMA",
    "BACKWARD_GEMM",
    "TOKEN_LEVEL_FUSION",
    "GRAD_IN_FORWARD_MAX_VOCAB",
    "DEFAULT_LOGITS_DTYPE",
    "DEFAULT_DWEIGHT_ACCUM",
    "CHUNK_BYTES",
    "GRAD_BYTES",
    "GEMM",
    "ELEMENTWISE",
    "enabled",
)


def _patch_lines():
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            if "monkeypatch.setattr(" in line:
                yield path.relative_to(TESTS), i + 1, line, lines[i - 1] if i else ""


def test_every_remaining_monkeypatch_is_a_commented_seam():
    bare = [
        f"{p}:{n}: {line.strip()}" for p, n, line, above in _patch_lines() if "# seam" not in line + above
    ]
    assert not bare, "set options with rk.use_options / set_options, or comment the seam:\n" + "\n".join(bare)


def test_no_former_global_is_patched():
    names = "|".join(FORMER_GLOBALS)
    pattern = re.compile(rf"""monkeypatch\.setattr\([^,]+,\s*["']({names})["']""")
    hits = [f"{p}:{n}: {line.strip()}" for p, n, line, _ in _patch_lines() if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_every_option_has_a_docs_row():
    page = (TESTS.parent / "docs" / "api" / "options.md").read_text()
    for field in dataclasses.fields(rk.Options):
        assert f"| `{field.name}` | " in page, field.name
