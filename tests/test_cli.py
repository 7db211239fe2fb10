"""``rlkernel --help`` / ``--version``: what a new user reads first (issue 29: the help showed raw
reST backticks and named one bench suite of three; there was no ``--version``)."""

from __future__ import annotations

import argparse

import pytest

import rlkernel
from rlkernel.bench import SUITES
from rlkernel.cli import build_parser, main


def _help_texts() -> dict[str, str]:
    parser = build_parser()
    texts = {"rlkernel": parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts |= {f"rlkernel {name}": sub.format_help() for name, sub in action.choices.items()}
    return texts


def test_help_is_plain_text_and_names_every_bench_suite():
    texts = _help_texts()
    assert set(texts) == {"rlkernel", "rlkernel demo", "rlkernel bench", "rlkernel consistency"}
    for name, text in texts.items():
        assert "``" not in text and ":func:" not in text, name
    top = " ".join(texts["rlkernel"].split())
    assert f"run a benchmark suite ({', '.join(SUITES)})" in top and len(SUITES) >= 3
    assert "--version" in top and "PyPI" in top


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rlkernel {rlkernel.__version__} (torch ") and "triton" in out
