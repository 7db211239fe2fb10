"""The ``rlkernel`` command: ``rlkernel demo | bench | consistency``."""

from __future__ import annotations

import argparse
import sys


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from rlkernel.demo.cli import add_arguments, run

    p = sub.add_parser("demo", help="train a tiny Qwen3 policy with GRPO on a toy task (CPU by default)")
    add_arguments(p)
    p.set_defaults(func=run)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from rlkernel.bench.cli import add_arguments, run

    p = sub.add_parser("bench", help="run a benchmark suite (logits) or regenerate the README table")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkernel", description=__doc__)
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
