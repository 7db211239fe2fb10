"""The ``rlkernel`` command: ``rlkernel demo | bench | consistency``."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """rlkernel: GPU kernels and exact numerics for the RL loss path of LLM post-training.
Each command has its own --help."""
EPILOG = """examples:
  rlkernel demo                      train a tiny Qwen3 policy with GRPO (CPU: ~40 s to minutes)
  rlkernel consistency               rollout vs training log-probs, unpatched vs batch-invariant
  rlkernel bench logits --smoke      check the benchmark pipeline on the CPU (GPU runs measure)

docs: docs/ in the repository (make docs serves them); no package is on PyPI yet: install from
a clone (pip install -e .)."""


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from rlkernel.demo.cli import add_arguments, run

    p = sub.add_parser("demo", help="train a tiny Qwen3 policy with GRPO on a toy task (CPU by default)")
    add_arguments(p)
    p.set_defaults(func=run)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from rlkernel.bench import SUITES
    from rlkernel.bench.cli import add_arguments, run

    p = sub.add_parser(
        "bench", help=f"run a benchmark suite ({', '.join(SUITES)}) or regenerate the README table"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _add_consistency(sub: argparse._SubParsersAction) -> None:
    from rlkernel.invariant.consistency import add_arguments, run

    p = sub.add_parser(
        "consistency",
        help="rollout (KV-cache decode) vs training (prefill) log-probs, unpatched vs batch-invariant",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _version() -> str:
    """``rlkernel X (torch Y, triton Z or not installed)``."""
    import torch

    import rlkernel
    from rlkernel import _dispatch

    triton = "not installed"
    if _dispatch.triton_available():
        import triton as _triton

        triton = _triton.__version__
    return f"rlkernel {rlkernel.__version__} (torch {torch.__version__}, triton {triton})"


class _VersionAction(argparse.Action):
    """``--version``: print :func:`_version` and exit (computed only when asked: it imports triton)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())  # stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlkernel", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "--version", action=_VersionAction, help="print rlkernel's, torch's and triton's versions and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_consistency(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
