"""The README's benchmark table and the docs' results page, generated from result files only (never
from a live run): ``rlkernel bench --readme``.

* :func:`readme_block` is the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in
  README.md: one headline table of at most a dozen rows (:data:`HEADLINE`) in the users' call
  pattern (sliced logits, ragged hidden states, default arguments: DESIGN.md, "Performance method"),
  every peer in a column named with its version, then what each column ran.
* :func:`results_page` is the whole page ``docs/guides/benchmark-results.md``: every row of every
  ``<suite>.csv`` (:func:`rlkernel.bench.report.suite_table`).
* :func:`update_docs` writes both; text outside the README's markers is kept byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlkernel.bench.report import IMPL_ORDER, _cell, _num, read_csv, suite_table

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
RESULTS_PAGE = Path("docs/guides/benchmark-results.md")


@dataclass(frozen=True)
class Headline:
    """One headline row: a workload of a suite at the size ``pick`` selects, each of its size
    columns (``n_tokens``, ``vocab``) equal to a value, or the run's ``"min"`` / ``"max"`` of it."""

    suite: str
    workload: str
    what: str
    pick: dict[str, str] = field(default_factory=dict)


_DAPO, _DAPO_HIDDEN = "DAPO + KL loss from logits, fwd+bwd", "DAPO + KL loss from hidden states, fwd+bwd"
_GSPO, _MODEL = "GSPO loss from logits, fwd+bwd", "batch-invariant model (`patch_hf_model`)"
HEADLINE: tuple[Headline, ...] = (
    Headline("logits", "sliced_dapo_kl_fwd_bwd", _DAPO, {"vocab": "max"}),
    Headline("logits", "sliced_dapo_kl_fwd_bwd", _DAPO, {"vocab": "min"}),
    Headline("logits", "sliced_gspo_fwd_bwd", _GSPO, {"vocab": "max"}),
    Headline("logits", "sliced_gspo_fwd_bwd", _GSPO, {"vocab": "min"}),
    Headline("logits", "sliced_logprobs_entropy_fwd_bwd", "log-probs + entropy from logits, fwd+bwd",
             {"vocab": "max"}),  # fmt: skip
    Headline("logits", "sliced_logprobs_entropy_fwd", "log-probs + entropy from logits, fwd (old / ref)",
             {"vocab": "max"}),  # fmt: skip
    Headline("linear", "ragged_dapo_kl_fwd_bwd", _DAPO_HIDDEN, {"n_tokens": "min"}),
    Headline("linear", "ragged_dapo_kl_fwd_bwd", _DAPO_HIDDEN, {"n_tokens": "max"}),
    Headline("linear", "ragged_dapo_kl_frozen_fwd_bwd", _DAPO_HIDDEN + ", LM head frozen (LoRA)",
             {"n_tokens": "min"}),  # fmt: skip
    Headline("linear", "ragged_logprobs_entropy_fwd_bwd", "log-probs + entropy from hidden states, fwd+bwd",
             {"n_tokens": "min"}),  # fmt: skip
    Headline("invariant", "model_prefill", f"{_MODEL}, prefill"),
    Headline("invariant", "model_decode", f"{_MODEL}, decode step"),
)
# The peers' columns: the implementation, and its header from the run's environment columns.
PEERS = (
    ("liger", "Liger-Kernel {liger}"),
    ("trl", "TRL {trl} (`trl.kernels`)"),
    ("torch", "torch {torch}"),
    ("torch.compile", "torch.compile"),
)
# The floor column: the logits rows' copy-bandwidth model, the hidden rows' measured cuBLAS GEMMs.
FLOOR = {"logits": "ceiling", "linear": "cublas_gemms"}


SUITE_ORDER = ("logits", "linear", "invariant")  # the users' calls first; other suites after, by name


def _load(results_dir: Path) -> dict[str, list[dict[str, str]]]:
    """suite name -> its CSV rows, for every ``<suite>.csv`` under ``results_dir`` (:data:`SUITE_ORDER`)."""
    paths = sorted(Path(results_dir).glob("*.csv"))
    if not paths:
        raise FileNotFoundError(f"no benchmark CSVs under {results_dir}")
    rank = {name: i for i, name in enumerate(SUITE_ORDER)}
    paths.sort(key=lambda p: (rank.get(p.stem, len(rank)), p.stem))
    return {p.stem: read_csv(p) for p in paths}


def _param_keys(rows: Sequence[dict]) -> list[str]:
    keys = list(rows[0]) if rows else []
    return keys[keys.index("pass") + 1 : keys.index("impl")] if "pass" in keys and "impl" in keys else []


def _select(rows: Sequence[dict], h: Headline) -> dict[str, dict] | None:
    """impl -> row of the headline's workload at the size it picks (None: not in the run)."""
    mine = [r for r in rows if r["workload"] == h.workload]
    for key, want in h.pick.items():
        values = [_num(r.get(key)) for r in mine if _num(r.get(key)) is not None]
        if want in ("min", "max") and values:
            target = min(values) if want == "min" else max(values)
            mine = [r for r in mine if _num(r.get(key)) == target]
        else:
            mine = [r for r in mine if str(r.get(key)) == want]
    return {r["impl"]: r for r in mine} or None


def _size(row: dict, params: Sequence[str]) -> str:
    def n(key: str) -> str:
        v = _num(row.get(key))
        return f"{int(v):,}" if v is not None else str(row.get(key))

    if "vocab" in params and "hidden" not in params:
        return f"N = {n('n_tokens')}, V = {n('vocab')}"
    if "hidden" in params:
        scored = f" ({n('scored_tokens')} scored)" if row.get("scored_tokens") else ""
        return f"N = {n('n_tokens')}{scored}, H = {n('hidden')}, V = {n('vocab')}"
    return str(row.get("shape") or "")


def _versions(rows: Sequence[dict], column: str) -> str:
    seen = sorted({str(r.get(column)) for r in rows if r.get(column)})
    return " / ".join(seen) or "—"


def _ratio(rk: dict | None, peers: list[dict]) -> str:
    """rlkernel's time over the fastest measured peer's: isolated, and back to back where timed."""
    if not rk or _num(rk.get("median_ms")) is None:
        return "—"
    measured = [p for p in peers if p.get("status") in ("ok", "model") and _num(p.get("median_ms"))]
    if not measured:
        return "—"
    iso = _num(rk["median_ms"]) / min(_num(p["median_ms"]) for p in measured)
    b2b = [_num(p.get("b2b_ms")) for p in measured if _num(p.get("b2b_ms"))]
    if _num(rk.get("b2b_ms")) and b2b:
        return f"{iso:.2f}× / {_num(rk['b2b_ms']) / min(b2b):.2f}×"
    return f"{iso:.2f}×"


def headline_table(suites: dict[str, list[dict[str, str]]]) -> str:
    """The headline rows present in ``suites`` as one markdown table (empty if none is)."""
    picked = []
    for h in HEADLINE:
        by_impl = _select(suites.get(h.suite, []), h)
        # "min" and "max" of a run with one size pick the same rows: shown once
        if by_impl is not None and by_impl not in [seen for _, seen in picked]:
            picked.append((h, by_impl))
    if not picked:
        return ""
    used = [r for _, by_impl in picked for r in by_impl.values()]
    versions = {k: _versions(used, k) for k in ("liger", "trl", "torch")}
    peer_heads = [fmt.format(**versions) for _, fmt in PEERS]
    heads = ["call (users' pattern)", "size", "rlkernel", *peer_heads, "floor", "rlkernel ÷ fastest peer"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for h, by_impl in picked:
        any_row = next(iter(by_impl.values()))
        params = _param_keys(suites[h.suite])
        peers = [by_impl.get(impl) for impl, _ in PEERS]
        floor = by_impl.get(FLOOR.get(h.suite, ""))
        floor_cell = _cell(floor).split(", ")[0] if floor else "—"
        cells = [h.what, _size(any_row, params), _cell(by_impl.get("rlkernel")), *(_cell(p) for p in peers),
                 floor_cell, _ratio(by_impl.get("rlkernel"), [p for p in peers if p])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_line(suites: dict[str, list[dict[str, str]]]) -> str:
    runs = []
    for name, rows in suites.items():
        if rows:
            r = rows[0]
            runs.append(f"`{name}` on {r.get('gpu')} {r.get('date_utc', '')[:10]} at `{r.get('commit')}`")
    smoke = any(rows and rows[0].get("device") == "cpu" for rows in suites.values())
    warn = " **CPU smoke run: not a performance measurement.**" if smoke else ""
    return f"Runs: {', '.join(runs)} (each suite's rows from one run, on one GPU).{warn}"


PEER_NOTES = """\
Cells: median ms of an isolated call (the device idle before it), then (logits rows) per call back
to back in a loop of 20, then the peak memory above the inputs. The logits are `out[:, 127:-1]` of a
`[8, 1152, V]` model output that requires grad, the hidden states the same window of `[8, 1152,
4096]`, response lengths uniform in [T/4, T]; every call with default arguments.

* rlkernel: `fused_policy_loss`, `token_logprobs`, `linear_token_logprobs`; the model rows: the HF
  Qwen3 model after `patch_hf_model`.
* Liger-Kernel: `GrpoLossFunction` (logits), `LigerFusedLinearGRPOLoss` (hidden states); losses only.
* TRL: `trl.kernels.selective_log_softmax_and_entropy` (logits), the fused LM head
  `ChunkedLogProbFunction` its GRPO trainer installs (hidden states; its log-probs feed the plain
  loss).
* torch: the plain PyTorch a trainer writes (`log_softmax(z.float() / T)`, the RL algebra as verl
  writes it); the model rows: the unpatched HF model with SDPA attention. torch.compile: the same
  function under `torch.compile` (inductor). FlashAttention-2 (`flash_attn`) was not installed on the
  GPU machine: its invariant-suite rows are skipped.
* floor: logits rows, the minimal traffic at the copy bandwidth measured in the run; hidden-state
  rows, the workload's cuBLAS GEMMs over the scored rows, measured.
* rlkernel ÷ fastest peer: below 1 is faster than every peer (isolated / back to back)."""


def readme_block(results_dir: Path) -> str:
    """The generated text for between the README's markers: the headline table and its notes."""
    suites = _load(results_dir)
    note = (
        f"<!-- generated by `rlkernel bench --readme` from {Path(results_dir).as_posix()}/*.csv; "
        "do not edit by hand -->"
    )
    table = headline_table(suites) or "(no headline workload in these results)"
    page = RESULTS_PAGE.as_posix()
    link = f"Every row of every suite, with the ceilings of each run: [{page}]({page})."
    return "\n\n".join([note, _run_line(suites), table, PEER_NOTES, link])


def results_page(results_dir: Path) -> str:
    """The whole generated results page: every suite's full table."""
    suites = _load(results_dir)
    tables = [f"## `{name}`\n\n{suite_table(rows)}" for name, rows in suites.items() if rows]
    head = [
        "# Benchmark results",
        "",
        f"<!-- generated by `rlkernel bench --readme` from {Path(results_dir).as_posix()}/*.csv; "
        "do not edit by hand -->",
        "",
        "Every row of the committed runs (`benchmarks/results/<suite>.csv`), one table per suite, in the "
        "order each run wrote them: the users' call pattern first (sliced logits, ragged hidden states), "
        "then the contiguous second view. The README shows the headline rows; the method, the "
        "workloads and what each implementation is given are in [Benchmarks](benchmarks.md).",
        "",
        "Columns: " + ", ".join(f"`{i}`" for i in IMPL_ORDER) + " and the suite's own implementations "
        "(the linear suite's `cublas_gemms` floor and invariant-mode rows; the invariant suite's "
        "`flash_attn`), then `ceiling` (the roofline of the run's measured copy bandwidth and GEMM rate).",
    ]
    return "\n".join(head) + "\n\n" + "\n\n".join(tables) + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` with everything between the markers replaced by ``block``; ValueError if no markers."""
    b, e = text.find(BEGIN), text.find(END)
    if b < 0 or e < 0 or e < b:
        raise ValueError(f"README has no {BEGIN} ... {END} block to rewrite")
    return text[: b + len(BEGIN)] + "\n" + block.strip("\n") + "\n" + text[e:]


def update_docs(readme: Path, results_dir: Path, page: Path | None = None) -> list[Path]:
    """Rewrite the marked block of ``readme`` and (when given) the whole ``page`` from
    ``results_dir``; returns the files that changed."""
    readme = Path(readme)
    if not readme.exists():
        raise FileNotFoundError(f"{readme} does not exist")
    changed = []
    old = readme.read_text()
    new = replace_block(old, readme_block(results_dir))
    if new != old:
        readme.write_text(new)
        changed.append(readme)
    if page is not None:
        page = Path(page)
        text = results_page(results_dir)
        if not page.exists() or page.read_text() != text:
            page.write_text(text)
            changed.append(page)
    return changed
