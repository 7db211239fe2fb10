"""Autograd state the memory-saving Functions of ``ops`` consult: whether the backward running now
retains its graph, and the error of a backward that finds its state consumed by an earlier one.

A Function that writes its gradient in place or hands out a buffer computed in the forward can do
so only in the last backward through its graph: a backward with ``retain_graph=True`` (or
``create_graph=True``) will be followed by another that reads the same state. No Triton here, so
every module of ``ops`` can import it.
"""

from __future__ import annotations

import torch


def graph_retained() -> bool | None:
    """Whether the backward running now keeps its graph for another backward (``retain_graph=True``
    or ``create_graph=True``): then a Function must neither overwrite what it saved nor hand out a
    buffer it reads again. ``None`` when this torch cannot tell (before 2.5)."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return None if keep_graph is None else bool(keep_graph())


def second_backward_error(what: str, avoid: str) -> RuntimeError:
    """The error of a backward that finds its state consumed by an earlier one: ``what`` says how
    it was consumed, ``avoid`` how to run two backwards all the same."""
    if graph_retained() is None:
        return RuntimeError(
            f"a second backward through this graph is not supported on this torch: {what}, and this "
            "torch cannot tell whether a backward retains its graph (torch >= 2.5 can, and then "
            f"supports retain_graph=True); to backward twice, {avoid}"
        )
    return RuntimeError(
        "Trying to backward through the graph a second time, but the previous backward did not "
        f"retain it ({what}): pass retain_graph=True to every backward but the last"
    )
