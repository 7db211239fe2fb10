"""The README's benchmark table and the docs' results page, generated from result files only (never
from a live run): ``rlkernel bench --readme``.

* :func:`readme_block` is the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in
  README.md: one headline table of at most a dozen rows (:data:`HEADLINE`) in the users' call
  pattern (sliced logits, ragged hidden states, default arguments: DESIGN.md, "Performance method"),
  every peer in a column named with its version, then what each column ran.
* :func:`results_page` is the whole page ``docs/guides/benchmark-results.md``: every row of every
  ``<suite>.csv`` (:func:`rlkernel.bench.report.suite_table`), and the several-GPU section from
  ``multigpu.csv`` (:func:`multigpu_section`: the speed-up and ratio tables; "not measured" without
  the file).
* :func:`update_docs` writes both; text outside the README's markers is kept byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlkernel.bench.report import IMPL_ORDER, _cell, _ms, _num, read_csv, suite_table

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
    newer: str | None = None  # a later (partial) run of the suite to take the row from, when committed

    def source(self, suites: dict) -> str:
        """The suite the row comes from: ``newer`` where it holds the workload, else ``suite``."""
        if self.newer and any(r.get("workload") == self.workload for r in suites.get(self.newer, [])):
            return self.newer
        return self.suite


_DAPO, _DAPO_HIDDEN = "DAPO + KL loss from logits, fwd+bwd", "DAPO + KL loss from hidden states, fwd+bwd"
_GSPO, _MODEL = "GSPO loss from logits, fwd+bwd", "batch-invariant model (`patch_hf_model`)"
# Every logits row from the last whole-suite run (``newer`` names a later partial run when one is
# committed: none now).
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
    Headline("invariant_long", "model_long_train", f"{_MODEL}, training step, long context",
             {"shape": "qwen3-8b-slice B=1 T=32768"}),  # fmt: skip
    Headline("invariant_long", "model_long_decode", f"{_MODEL}, decode step, long cache",
             {"shape": "qwen3-8b-slice B=1 cache=32768"}),  # fmt: skip
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


# The users' calls first; other suites after, by name.
SUITE_ORDER = ("logits", "linear", "invariant", "invariant_long")
# The several-GPU suite: its rows have a section of their own on the results page (multigpu_section).
MULTI_GPU = "multigpu"


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
        source = h.source(suites)
        by_impl = _select(suites.get(source, []), h)
        # "min" and "max" of a run with one size pick the same rows: shown once
        if by_impl is not None and by_impl not in [seen for _, _, seen in picked]:
            picked.append((h, source, by_impl))
    if not picked:
        return ""
    used = [r for _, _, by_impl in picked for r in by_impl.values()]
    versions = {k: _versions(used, k) for k in ("liger", "trl", "torch")}
    peer_heads = [fmt.format(**versions) for _, fmt in PEERS]
    heads = ["call (users' pattern)", "size", "rlkernel", *peer_heads, "floor", "rlkernel ÷ fastest peer"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for h, source, by_impl in picked:
        any_row = next(iter(by_impl.values()))
        params = _param_keys(suites[source])
        peers = [by_impl.get(impl) for impl, _ in PEERS]
        floor = by_impl.get(FLOOR.get(h.suite, ""))
        floor_cell = _cell(floor).split(", ")[0] if floor else "—"
        cells = [h.what, _size(any_row, params), _cell(by_impl.get("rlkernel")), *(_cell(p) for p in peers),
                 floor_cell, _ratio(by_impl.get("rlkernel"), [p for p in peers if p])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _world_sizes(rows: Sequence[dict]) -> list[str]:
    """The GPU counts of a several-GPU suite's runs, as written (``world_size``), in order."""
    return sorted({str(r.get("world_size")) for r in rows if r.get("world_size")}, key=lambda x: int(x))


def _run_line(suites: dict[str, list[dict[str, str]]]) -> str:
    runs = []
    for name, rows in suites.items():
        if rows:
            r = rows[0]
            worlds = "/".join(_world_sizes(rows))
            gpu = f"{worlds}× {r.get('gpu')}" if name == MULTI_GPU and worlds else r.get("gpu")
            runs.append(f"`{name}` on {gpu} {r.get('date_utc', '')[:10]} at `{r.get('commit')}`")
    smoke = any(rows and rows[0].get("device") == "cpu" for rows in suites.values())
    warn = " **CPU smoke run: not a performance measurement.**" if smoke else ""
    each = "each suite's rows from one run, on one GPU"
    if suites.get(MULTI_GPU):
        each += f"; `{MULTI_GPU}`'s from one run per GPU count"
    return f"Runs: {', '.join(runs)} ({each}).{warn}"


PEER_NOTES = """\
Cells: median ms of an isolated call (the device idle before it), then (logits rows) per call back
to back in a loop of 20 and (host) the isolated call's host time, start to return, then the peak
memory above the inputs. The logits are `out[:, 127:-1]` of a
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
    """The whole generated results page: every suite's full table, then the several-GPU section."""
    suites = _load(results_dir)
    tables = [
        f"## `{name}`\n\n{suite_table(rows)}" for name, rows in suites.items() if rows and name != MULTI_GPU
    ]
    tables.append(multigpu_section(suites.get(MULTI_GPU), results_dir))
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


# --------------------------------------------------------------------------------------------------
# The several-GPU section
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GpuTable:
    """How one workload of the ``multigpu`` suite is shown: a title, what is run, and its columns
    after GPUs and size, each ``(header, impl)`` (the row's cell), ``(header, a, b)`` (a's median ÷
    b's) or ``(header, impl, "/gpus")`` (impl's median ÷ the GPU count)."""

    title: str
    what: str
    columns: tuple[tuple[str, ...], ...]


_GPU_TABLES = {
    "tp_logprobs_entropy_fwd_bwd": _GpuTable(
        "Tensor (vocab) parallel LM head",
        "`linear_token_logprobs(hidden, weight_shard, ids, tp_group=..., return_entropy=True)` forward + "
        "backward (trainable weight and hidden, fixed random upstream gradients), each rank holding an "
        "even contiguous share of the [V, H] head, against the whole head on one GPU in the same run. "
        "Perfect split: the 1-GPU time ÷ the GPU count. GEMM floor: the 4 GEMMs (2·N·H·V each) at the "
        "GEMM rate measured in the run, over the GPUs.",
        (("1 GPU (`rlkernel`)", "rlkernel"), ("TP (`rlkernel_tp`)", "rlkernel_tp"),
         ("speed-up (1 GPU ÷ TP)", "rlkernel", "rlkernel_tp"), ("perfect split", "rlkernel", "/gpus"),
         ("GEMM floor", "ceiling"), ("all-reduce of dhidden alone", "all_reduce_dhidden")),
    ),
    "fsdp2_head_fwd_bwd": _GpuTable(
        "FSDP2 (DTensor) LM head",
        "`linear_token_logprobs(hidden, weight, ids, return_entropy=True)` forward + backward with the "
        "head a `Shard(0)` DTensor over the GPUs (all-gathered in bf16, its gradient reduce-scattered: "
        "in bf16 for bf16 shards, in fp32 for fp32 shards, FSDP2's mixed precision) against the plain "
        "full head on every GPU.",
        (("plain head (`rlkernel`)", "rlkernel"), ("DTensor, bf16 shards", "rlkernel_dtensor"),
         ("÷ plain", "rlkernel_dtensor", "rlkernel"), ("DTensor, fp32 shards", "rlkernel_dtensor_fp32"),
         ("÷ plain", "rlkernel_dtensor_fp32", "rlkernel"),
         ("all-gather + reduce-scatter alone", "all_gather_reduce_scatter")),
    ),
}  # fmt: skip


def _gpu_column(column: tuple[str, ...], by_impl: dict[str, dict], gpus: str) -> str:
    if len(column) == 2:
        return _gpu_cell(by_impl.get(column[1]))
    num = by_impl.get(column[1])
    a = _num(num.get("median_ms")) if num and num.get("status") == "ok" else None
    if column[2] == "/gpus":
        return f"{_ms(a / int(gpus))} ms" if a else "—"
    den = by_impl.get(column[2])
    b = _num(den.get("median_ms")) if den and den.get("status") == "ok" else None
    return f"{a / b:.2f}×" if a and b else "—"


def _gpu_cell(row: dict | None) -> str:
    """``median (p20–p80), peak`` of a row; its status word if it has no time."""
    if row is None:
        return "—"
    ms = _num(row.get("median_ms"))
    if ms is None or row.get("status") not in ("ok", "model"):
        return str(row.get("status", "")).split(":")[0] or "—"
    lo, hi, gb = _num(row.get("p20_ms")), _num(row.get("p80_ms")), _num(row.get("peak_extra_gb"))
    text = f"{_ms(ms)} ms" + (f" ({_ms(lo)}–{_ms(hi)})" if lo is not None and hi is not None else "")
    return text + (f", {gb:.2f} GB" if gb is not None and row.get("impl") != "ceiling" else "")


def _gpu_runs_line(rows: Sequence[dict]) -> str:
    first_of_run: dict[str, dict] = {}
    for r in rows:
        first_of_run.setdefault(str(r.get("world_size")), r)
    parts = []
    for world in _world_sizes(rows):
        r = first_of_run[world]
        gemm = _num(r.get("ceiling_gemm_tflops"))
        rate = f", bf16 GEMM {gemm:.3g} TFLOP/s on rank 0's GPU" if gemm else ""
        parts.append(f"{world} × {r.get('gpu')}: torch {r.get('torch')}, triton {r.get('triton') or '—'}, "
                     f"{r.get('date_utc')}, commit `{r.get('commit')}`{rate}")  # fmt: skip
    warn = " **CPU smoke run: not a performance measurement.**" if rows[0].get("device") == "cpu" else ""
    return "Runs (one torchrun per GPU count): " + "; ".join(parts) + "." + warn


def multigpu_section(rows: Sequence[dict] | None, results_dir: Path) -> str:
    """The results page's several-GPU section from the ``multigpu`` rows (None: not measured)."""
    head = [
        f"## Several GPUs (`{MULTI_GPU}`)",
        "",
        f"`rlkernel bench {MULTI_GPU}`: one torchrun run per GPU count, the single-GPU baseline measured "
        "in the same run on rank 0's GPU (method and rows: [Several GPUs](multi-gpu.md#benchmark)).",
    ]
    if not rows:
        where = f"{Path(results_dir).as_posix()}/{MULTI_GPU}.csv"
        missing = (f"Not measured: there is no `{where}`. Run `rlkernel bench {MULTI_GPU}` on a machine "
                   "with two or more GPUs, then `rlkernel bench --readme`.")  # fmt: skip
        return "\n".join([*head, "", missing])
    params = [p for p in _param_keys(rows) if p not in ("gpus", "world_size")]
    groups: dict[str, dict[tuple, dict[str, dict]]] = {}
    for r in rows:
        key = (str(r.get("world_size")), *(str(r.get(p)) for p in params))
        groups.setdefault(str(r["workload"]), {}).setdefault(key, {})[str(r["impl"])] = r
    cells = ("Cells: median ms of an isolated step (20th–80th percentile), peak extra memory on rank 0; "
             "a step over several GPUs lasts until its slowest rank is done.")  # fmt: skip
    out = [*head, "", _gpu_runs_line(rows), "", cells]
    for workload, by_size in groups.items():
        spec = _GPU_TABLES.get(workload)
        if spec is None:  # a workload this page does not know yet: every implementation's cell
            impls = dict.fromkeys(i for g in by_size.values() for i in g)
            spec = _GpuTable(workload, "", tuple((f"`{i}`", i) for i in impls))
        heads = ["GPUs", "size", *(c[0] for c in spec.columns)]
        out += ["", f"### {spec.title} (`{workload}`)", ""]
        if spec.what:
            out += [spec.what, ""]
        out += ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for key, by_impl in by_size.items():
            size = _size(next(iter(by_impl.values())), params)
            cells = [key[0], size, *(_gpu_column(c, by_impl, key[0]) for c in spec.columns)]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
