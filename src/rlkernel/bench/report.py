"""Reports of a run's rows: the plot, the full markdown table of a suite, the console table.

* :func:`plot` draws ``<suite>.png``: one panel per workload kind, one group of bars per size, one
  bar per implementation (median ms, log scale when the spread calls for it), the ``ceiling`` as a
  black tick across its group.
* :func:`suite_table`: a suite's rows as one markdown table, with the run's environment above it
  (the docs' results page, :mod:`rlkernel.bench.readme`).
* :func:`format_table`: the compact table printed at the end of a run.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

IMPL_ORDER = ("rlkernel", "torch", "torch.compile", "liger", "trl")
# Columns that differ between the implementations of one workload and size (the multigpu suite's
# ``gpus``: 1 for the baseline, W for the multi-GPU rows): a plot group and a printed block ignore them.
ONE_RUN_COLUMNS = ("gpus",)
COLORS = {
    "rlkernel": "#d62728",
    "torch": "#7f7f7f",
    "torch.compile": "#1f77b4",
    "liger": "#2ca02c",
    "trl": "#ff7f0e",
}


def read_csv(path: Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def _num(v: object) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _param_columns(rows: Sequence[dict]) -> list[str]:
    """The suite-specific columns: those between ``pass`` and ``impl`` in the CSV header."""
    keys = list(rows[0]) if rows else []
    if "pass" in keys and "impl" in keys:
        return keys[keys.index("pass") + 1 : keys.index("impl")]
    return []


def _size_label(row: dict, params: Sequence[str], sep: str = " ") -> str:
    short = {"n_tokens": "N", "vocab": "V"}
    return sep.join(f"{short.get(p, p)}={row.get(p)}" for p in params)


def _group(rows: Sequence[dict], params: Sequence[str]) -> dict[str, dict[str, dict[str, dict]]]:
    """workload -> size label -> impl -> row, in file order (the plot's panels)."""
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for r in rows:
        out.setdefault(str(r["workload"]), {}).setdefault(_size_label(r, params), {})[str(r["impl"])] = r
    return out


def _in_file_order(rows: Sequence[dict], params: Sequence[str]) -> dict[tuple[str, str], dict[str, dict]]:
    """(workload, size label) -> impl -> row, in the order the run wrote them (the table's lines: a
    suite that leads with some workloads keeps them first)."""
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        out.setdefault((str(r["workload"]), _size_label(r, params)), {})[str(r["impl"])] = r
    return out


def plot(rows: Sequence[dict], path: Path, *, title: str = "") -> Path:
    """Bars of median ms per implementation per workload; returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    params = [p for p in _param_columns(rows) if p not in ONE_RUN_COLUMNS]
    groups = _group(rows, params)
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
    impls += sorted({str(r["impl"]) for r in rows} - set(impls) - {"ceiling"})
    ncols = min(2, max(1, len(groups)))
    nrows = max(1, -(-len(groups) // ncols))
    # Fixed margins rather than constrained layout: the same look, a fraction of the drawing time.
    fig = Figure(figsize=(7.5 * ncols, 3.8 * nrows))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.92, wspace=0.18, hspace=0.55)
    FigureCanvasAgg(fig)
    for k, (workload, sizes) in enumerate(groups.items()):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        values = []
        present = [i for i in impls if any(_num(s.get(i, {}).get("median_ms")) for s in sizes.values())]
        width = 0.8 / max(1, len(present))
        for j, impl in enumerate(present):
            xs, ys = [], []
            for g, by_impl in enumerate(sizes.values()):
                ms = _num(by_impl.get(impl, {}).get("median_ms"))
                if ms:
                    xs.append(g - 0.4 + width * (j + 0.5))
                    ys.append(ms)
            values += ys
            if xs:
                ax.bar(xs, ys, width, label=impl, color=COLORS.get(impl))
        for g, by_impl in enumerate(sizes.values()):
            ms = _num(by_impl.get("ceiling", {}).get("median_ms"))
            if ms:
                values.append(ms)
                ax.hlines(
                    ms, g - 0.45, g + 0.45, colors="black", linewidth=1.5, label="ceiling" if g == 0 else None
                )
        pos = [v for v in values if v > 0]
        if pos and max(pos) / min(pos) > 20:
            ax.set_yscale("log")
        ax.set_xticks(range(len(sizes)), [label.replace(" ", "\n") for label in sizes], fontsize=8)
        ax.set_ylabel("median ms")
        ax.set_title(workload, fontsize=10)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return Path(path)


def _ms(x: float) -> str:
    """3 significant digits, trailing zeros kept: 0.108, 1.00, 20.0, 123."""
    return f"{x:.0f}" if x >= 100 else f"{x:#.3g}"


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    status = str(row.get("status", ""))
    if status not in ("ok", "model"):
        return status.split(":")[0] or "—"
    ms, gb = _num(row.get("median_ms")), _num(row.get("peak_extra_gb"))
    if ms is None:
        return "—"
    b2b, host = _num(row.get("b2b_ms")), _num(row.get("host_ms"))
    text = f"{_ms(ms)} / {_ms(b2b)} ms" if b2b is not None else f"{_ms(ms)} ms"
    if host is not None:  # (a CSV of a run before the column has none: its cells stay as they were)
        text += f" (host {_ms(host)})"
    if gb is None or row.get("impl") == "ceiling":
        return text
    return text + (f", {gb:.1f} GB" if gb >= 10 else f", {gb:.2f} GB")


def suite_table(rows: Sequence[dict]) -> str:
    """A markdown table for one suite's rows (with the environment line above it)."""
    if not rows:
        return ""
    params = _param_columns(rows)
    first = rows[0]
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
    impls += sorted({str(r["impl"]) for r in rows} - set(impls) - {"ceiling"})
    head = ["workload", *params, *impls, "ceiling", "rlkernel vs torch", "rlkernel % of copy BW"]
    warn = " **CPU smoke run: not a performance measurement.**" if first.get("device") == "cpu" else ""
    # Columns a CSV of an older run lacks stay out of the header line (its text stays the same).
    trl = f", trl {first.get('trl') or '—'}" if "trl" in first else ""
    loops = sorted({str(r.get("b2b_calls")) for r in rows if _num(r.get("b2b_ms")) is not None})
    if loops:
        host = " (host: an isolated call's host ms)" if any(_num(r.get("host_ms")) for r in rows) else ""
        cells_doc = (
            f"Cells: median ms of an isolated call / per call back to back ({', '.join(loops)} calls, "
            f"one sync){host}, peak extra memory."
        )
    else:
        cells_doc = "Cells: median ms, peak extra memory."
    lines = [
        f"**{first.get('suite')}** on {first.get('gpu')}: torch {first.get('torch')}, triton "
        f"{first.get('triton') or '—'}, liger-kernel {first.get('liger') or '—'}{trl}, "
        f"{first.get('date_utc')}, commit `{first.get('commit')}`. Ceilings measured in the same run: copy "
        f"{_num(first.get('ceiling_copy_tbps')) or 0:.2f} TB/s, bf16 GEMM "
        f"{_num(first.get('ceiling_gemm_tflops')) or 0:.0f} TFLOP/s. {cells_doc}" + warn,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for (workload, _), by_impl in _in_file_order(rows, params).items():
        any_row = next(iter(by_impl.values()))
        rk = by_impl.get("rlkernel", {})
        speed, frac = _num(rk.get("speedup_vs_baseline")), _num(rk.get("frac_copy_bw"))
        cells = [
            f"{workload} ({any_row.get('pass')})",
            *(str(any_row.get(p, "")) for p in params),
            *(_cell(by_impl.get(i)) for i in impls),
            _cell(by_impl.get("ceiling")),
            f"{speed:.2f}×" if speed else "—",
            f"{100 * frac:.0f}%" if frac is not None else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: Any, spec: str, suffix: str = "") -> str:
    return "" if v is None else f"{v:{spec}}{suffix}"


def format_table(rows: list[dict], param_columns: Sequence[str], baseline: str = "torch") -> str:
    """The compact table printed at the end of a run (one line per row, a blank line per workload)."""
    head = ["workload", *param_columns, "impl", "ms", "b2b ms", "host ms", "peak GB", "TB/s", "%copy",
            f"vs {baseline}", "status"]  # fmt: skip
    body = []
    for r in rows:
        body.append(
            [
                str(r["workload"]),
                *(str(r.get(c, "")) for c in param_columns),
                str(r["impl"]),
                _fmt(r.get("median_ms"), ".3f"),
                _fmt(r.get("b2b_ms"), ".3f"),
                _fmt(r.get("host_ms"), ".3f"),
                _fmt(r.get("peak_extra_gb"), ".2f"),
                _fmt(r.get("tbps"), ".2f"),
                _fmt(None if r.get("frac_copy_bw") is None else 100 * r["frac_copy_bw"], ".0f", "%"),
                _fmt(r.get("speedup_vs_baseline"), ".2f", "x"),
                "" if r["status"] in ("ok", "model") else str(r["status"])[:60],
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    prev = None
    for r, cells in zip(rows, body, strict=True):
        key = (r["workload"], *(r.get(c) for c in param_columns if c not in ONE_RUN_COLUMNS))
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    return "\n".join(lines)
