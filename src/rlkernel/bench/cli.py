"""``rlkernel bench``: run a benchmark suite, or regenerate the README table and the docs' results page
from committed results.

Examples::

    rlkernel bench logits                          # the full suite on the GPU -> benchmarks/results/
    rlkernel bench logits --quick --out /tmp/b     # fewer repetitions
    rlkernel bench logits --n 8192 --v 151936 --impl rlkernel,liger --workload sliced_dapo_kl_fwd_bwd
    rlkernel bench logits --smoke                  # tiny sizes on the CPU: checks the pipeline only
                                                   # (written to a new temporary folder)
    rlkernel bench multigpu                        # the LM head on 2, 4, ... GPUs (one torchrun each)
    rlkernel bench multigpu --gpus 2,4             # the GPU counts to run
    rlkernel bench --list                          # suites, workloads, implementations
    rlkernel bench --readme                        # README table + docs results page from the CSVs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rlkernel.bench.readme import RESULTS_PAGE

DEFAULT_OUT = Path("benchmarks/results")


def _csv_list(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in _csv_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser`` (used by ``rlkernel bench`` and ``python -m``)."""
    parser.add_argument("suite", nargs="?", help="the suite to run (see --list), e.g. 'logits'")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"output folder (default: {DEFAULT_OUT}; with --smoke a new temporary folder: a smoke run "
        "never writes over GPU results)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer repetitions (and sizes, where a suite has several)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU: checks the pipeline, measures nothing"
    )
    parser.add_argument("--n", type=_int_list, help="token counts, e.g. 4096,16384 (default: per suite)")
    parser.add_argument("--v", type=_int_list, help="vocabulary sizes, e.g. 32768,151936")
    parser.add_argument(
        "--impl", type=_csv_list, help="implementations to run (default: all but the opt-in variants)"
    )
    parser.add_argument("--workload", type=_csv_list, help="workload kinds to run (default: all)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--rounds", type=int, help="interleaved timing rounds (default: 5 of 3 calls; quick: 3 of 2)"
    )
    parser.add_argument(
        "--loop",
        type=int,
        help="calls per back-to-back loop, one sync per loop (default 20; 0: no back-to-back timing)",
    )
    parser.add_argument(
        "--gpus",
        type=_int_list,
        help="multigpu suite: the GPU counts to run, one torchrun each, e.g. 2,4 (default: 2, 4, 8, ... up "
        "to the GPUs present; --smoke: 2 CPU ranks)",
    )
    parser.add_argument("--list", action="store_true", help="list suites, workloads and implementations")
    parser.add_argument(
        "--readme",
        action="store_true",
        help="rewrite README.md's bench block and the docs' results page from the CSVs in --results",
    )
    parser.add_argument("--results", type=Path, default=DEFAULT_OUT, help="CSV folder for --readme")
    parser.add_argument("--readme-path", type=Path, default=Path("README.md"), help="README for --readme")
    parser.add_argument(
        "--results-page",
        type=Path,
        help=f"the full tables' page for --readme (default: {RESULTS_PAGE} beside the README)",
    )


def _options(args: argparse.Namespace, suite_name: str):
    import torch

    from rlkernel.bench.suite import BenchError, Options

    if args.gpus is not None and suite_name != "multigpu":
        raise BenchError(f"--gpus applies to the multigpu suite, not to {suite_name!r}")
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise BenchError(
            f"no CUDA device: run 'rlkernel bench {suite_name} --smoke' to check the pipeline on CPU"
        )
    if args.smoke:
        # aot_eager traces with Dynamo and AOTAutograd like inductor does, without minutes of C++ builds.
        timing = {"warmup": 0, "rounds": 2, "reps": 1, "compile_backend": "aot_eager"}
        timing |= {"loop_calls": 2, "loop_reps": 1}
    elif args.quick:
        timing = {"warmup": 1, "rounds": 3, "reps": 2, "loop_calls": 20, "loop_reps": 2}
    else:
        # 15 isolated calls per implementation: the medians of these memory-bound kernels are stable
        # to ~1 %; 3 back-to-back loops of 20 calls. The logits suite stays within ~4 minutes on an
        # H100 (torch.compile's compilations and plain torch's loops dominate).
        timing = {"warmup": 1, "rounds": 5, "reps": 3, "loop_calls": 20, "loop_reps": 3}
    if args.rounds is not None:
        if args.rounds < 1:
            raise BenchError(f"--rounds must be >= 1, got {args.rounds}")
        timing["rounds"] = args.rounds
    if args.loop is not None:
        if args.loop < 0:
            raise BenchError(f"--loop must be >= 0, got {args.loop}")
        timing["loop_calls"] = args.loop
    return Options(
        device=device,
        smoke=args.smoke,
        quick=args.quick,
        n_tokens=args.n,
        vocab=args.v,
        impls=args.impl,
        workloads=args.workload,
        gpus=args.gpus,
        **timing,
    )


def _smoke_over_measured_results(out: Path, suite_name: str) -> str | None:
    """Why a ``--smoke`` run must not write to ``out``: it holds this suite's results of a measured
    (non-smoke) run, which the CPU rows would replace (and ``--readme`` would then publish)."""
    path = out / f"{suite_name}.json"
    if not path.is_file():
        return None
    try:
        env = json.loads(path.read_text()).get("meta", {}).get("env", {})
    except (OSError, ValueError, AttributeError):
        env = {}
    if env.get("device") == "cpu" and "smoke" in str(env.get("gpu", "")):
        return None  # an earlier smoke run's files
    return (
        f"--out {out}: holds the {suite_name} results of a measured run ({path.name}); a --smoke run "
        "does not overwrite them: name another folder, or leave --out out (a new temporary folder)"
    )


def _list() -> None:
    from rlkernel.bench import SUITES

    for name, suite in SUITES.items():
        print(f"{name}: {suite.description}")
        print(f"  workloads:       {', '.join(suite.kinds)}")
        print(f"  implementations: {', '.join(i for i in suite.impls if i not in suite.variants)}")
        if suite.variants:
            print(f"  opt-in variants: {', '.join(suite.variants)} (run with --impl)")


def run(args: argparse.Namespace) -> int:
    """Run ``rlkernel bench`` with parsed ``args``; returns the exit code.

    0: all rows measured or skipped; 1: some implementation failed (its row says ``error``);
    2: bad command line (unknown suite, implementation, workload; no CUDA device without --smoke).
    """
    from rlkernel._cli_paths import (
        first_problem,
        input_dir_problem,
        input_file_problem,
        output_dir_problem,
        output_file_problem,
    )
    from rlkernel.bench import get_suite, harness, readme, report

    try:
        if args.list:
            _list()
            return 0
        if args.readme:
            page = args.results_page or args.readme_path.parent / RESULTS_PAGE
            problem = first_problem(
                input_dir_problem("--results", args.results),
                input_file_problem("--readme-path", args.readme_path, writable=True),
                output_file_problem("--results-page", page),
            )
            if problem:
                raise harness.BenchError(problem)
            changed = readme.update_docs(args.readme_path, args.results, page)
            for path in (args.readme_path, page):
                print(f"{path}: {'updated' if path in changed else 'already up to date'}")
            return 0
        if not args.suite:
            from rlkernel.bench import SUITES

            raise harness.BenchError(f"name a suite ({', '.join(sorted(SUITES))}) or pass --readme / --list")
        suite = get_suite(args.suite)
        # The results are written after the whole suite: an unusable --out must fail now.
        problem = output_dir_problem("--out", args.out) if args.out is not None else None
        if problem is None and args.smoke and args.out is not None:
            problem = _smoke_over_measured_results(args.out, suite.name)
        if problem:
            raise harness.BenchError(problem)
        options = _options(args, suite.name)
        out = args.out
        if out is None:
            # A smoke run measures nothing: it never goes to the committed GPU results by default.
            out = DEFAULT_OUT
            if args.smoke:
                out = Path(tempfile.mkdtemp(prefix=f"rlkernel-bench-{suite.name}-smoke-"))
        rows, meta = suite.runner(options) if suite.runner is not None else harness.run_suite(suite, options)
    except (harness.BenchError, FileNotFoundError, ValueError) as exc:
        print(f"rlkernel bench: error: {exc}", file=sys.stderr)
        return 2
    csv_path, json_path = harness.write_results(suite, rows, meta, out)
    written = [csv_path, json_path]
    if not args.no_plot:
        env = meta["env"]
        title = f"{suite.name} — {env['gpu']}, torch {env['torch']}, {env['date_utc']}, {env['commit']}"
        written.append(report.plot(rows, out / f"{suite.name}.png", title=title))
    print()
    print(report.format_table(rows, suite.param_columns, suite.baseline))
    print()
    print("wrote " + ", ".join(str(p) for p in written))
    errors = [r for r in rows if str(r["status"]).startswith(("error", "oom"))]
    if errors:
        print(f"{len(errors)} row(s) failed: see the status column", file=sys.stderr)
    return 1 if any(str(r["status"]).startswith("error") for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlkernel bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
