"""Which kernels a call runs — its *route* — as a value a user can read.

A call of ``fused_policy_loss`` (or of a log-prob primitive) can take one of a few routes: from
logits or from hidden states, a token-level loss whose per-token constants are built on the device
or on the host, a sequence-level objective in closed form, the ``[B, T]`` algebra differentiated
inside the forward, or the composed path (primitive, then ``policy_loss``); on the Triton kernels,
the PyTorch reference, or as registered custom ops inside ``torch.compile``. The choice is made by
one pure function per entry point (:func:`logprobs_route`, :func:`linear_route` here;
``rlkernel.rl.routes.choose_route`` for the loss) from facts about the inputs and the options, and
the result is a frozen :class:`Route`:

    out = rk.fused_policy_loss(cfg, logits=logits, ...)
    print(out.route)          # logits -> token-level loss (constants on the device), triton, 3 passes

    with rk.record_routes() as routes:      # the primitives have no output object to carry it
        logp = rk.linear_token_logprobs(hidden, weight, ids)
    print(routes[0])          # hidden -> log-probs, triton, epilogue GEMM, 4 GEMMs

This module is in ``ops`` (below ``rl``) because both layers choose routes; it imports only torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Literal

import torch

Source = Literal["logits", "hidden"]
Objective = Literal["logprobs", "token", "sequence", "autograd", "composed"]
Kernels = Literal["triton", "reference", "compiled"]
Plan = Literal["device", "host"]
Gemm = Literal["cublas", "epilogue", "invariant"]
Grouping = Literal["grouped", "whole-batch", "auto"]

_OBJECTIVE_WORDS = {
    "logprobs": "log-probs",
    "token": "token-level loss",
    "sequence": "sequence-level loss (closed form)",
    "autograd": "loss coefficients by autograd",
    "composed": "composed: log-probs, then policy_loss",
}


_FIELDS = {
    "source": ("logits", "hidden"),
    "objective": tuple(_OBJECTIVE_WORDS),
    "kernels": ("triton", "reference", "compiled"),
    "plan": (None, "device", "host"),
    "gemm": (None, "cublas", "epilogue", "invariant"),
    "grouping": (None, "grouped", "whole-batch", "auto"),
}


@dataclasses.dataclass(frozen=True)
class Route:
    """What a call runs.

    Attributes:
        source: ``"logits"`` or ``"hidden"`` (hidden states and the LM head: the logits never whole).
        objective: ``"logprobs"`` (a primitive), ``"token"`` (a token-level loss: per-token constants,
            then one fused launch), ``"sequence"`` (gspo, gspo_token, gmpo: closed-form per-sequence
            coefficients in one launch), ``"autograd"`` (any other objective: its ``[B, T]`` algebra
            differentiated inside the forward), ``"composed"`` (the primitive, then ``policy_loss``
            under autograd).
        kernels: ``"triton"``, ``"reference"`` (the PyTorch reference: CPU, float64, the
            ``reference`` backend) or ``"compiled"`` (inside ``torch.compile``: registered custom ops).
        passes: from logits, the passes over the ``[N, V]`` logits forward + backward (2: the
            gradient written during the forward; 3: forward, then backward's read and write; 1:
            no gradient); from hidden states, the ``[N, V, H]`` GEMMs (3: the fused loss; 4: the
            primitive's backward recomputes the logits; 1: no gradient). None on the reference.
        plan: a token-level or closed-form sequence-level loss's per-token constants: ``"device"``
            (counts, masked ids and the id check computed by the kernels themselves: the fewest host
            operations) or ``"host"`` (built with torch ops before the loss kernel); None for other
            objectives.
        gemm: hidden states only, the logits GEMMs: ``"epilogue"`` (the Triton LM-head GEMM with
            the log-softmax statistics in its epilogue), ``"cublas"`` (cuBLAS chunks and the
            log-prob kernels) or ``"invariant"`` (the batch-invariant GEMM of ``invariant=True``).
        grouping: hidden states with a weight gradient: ``"whole-batch"`` (one gradient group: one
            dweight GEMM over every row), ``"grouped"`` (groups of rows into an fp32 accumulator),
            or ``"auto"`` (whole batch when it fits, decided from the active row count).
        vocab_parallel: the LM head is vocabulary-sharded over a ``tp_group``.

    Raises:
        ValueError: a field outside its values above; TypeError: ``vocab_parallel`` not a bool.
    """

    source: Source
    objective: Objective
    kernels: Kernels
    passes: int | None = None
    plan: Plan | None = None
    gemm: Gemm | None = None
    grouping: Grouping | None = None
    vocab_parallel: bool = False

    def __post_init__(self) -> None:
        for name, allowed in _FIELDS.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Route.{name} must be one of {allowed}, got {value!r}")
        if self.passes is not None and (isinstance(self.passes, bool) or not isinstance(self.passes, int)
                                        or self.passes < 1):  # fmt: skip
            raise ValueError(f"Route.passes must be None or an int >= 1, got {self.passes!r}")
        if not isinstance(self.vocab_parallel, bool):
            raise TypeError(f"Route.vocab_parallel must be a bool, got {self.vocab_parallel!r}")

    @property
    def key(self) -> tuple[str, str, str, str | None]:
        """``(source, objective, kernels, plan)``: what picks the code that runs the route."""
        return (self.source, self.objective, self.kernels, self.plan)

    def __str__(self) -> str:
        what = _OBJECTIVE_WORDS[self.objective]
        if self.plan is not None:
            what += f" (constants on the {self.plan})"
        parts = [f"{self.source} -> {what}", self.kernels]
        if self.vocab_parallel:
            parts.append("vocab-parallel")
        if self.gemm is not None:
            parts.append(f"{self.gemm} GEMM")
        if self.passes is not None:
            noun = "GEMM" if self.source == "hidden" else "pass"
            plural = "" if self.passes == 1 else ("s" if noun == "GEMM" else "es")
            parts.append(f"{self.passes} {noun}{plural}")
        if self.grouping is not None:
            parts.append(self.grouping)
        return ", ".join(parts)


# ------------------------------------------------------------------------------------ recording
_local = threading.local()


@contextlib.contextmanager
def record_routes() -> Iterator[list[Route]]:
    """Collect the :class:`Route` of every rlkernel call made in this thread inside the block
    (``token_logprobs``, ``linear_token_logprobs``, ``fused_policy_loss``), in call order.

    Yields:
        The list, filled as the calls are made (a ``fused_policy_loss`` call records its own route,
        not the routes of the primitives it runs). Blocks nest: an inner block's calls are also in
        the outer list. Nothing is recorded outside a block, and no setting changes: this is an
        observer, not a switch.
    """
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    routes: list[Route] = []
    stack.append(routes)
    try:
        yield routes
    finally:
        stack.remove(routes)  # by identity: blocks of two generators may exit out of order


def recording() -> bool:
    """Whether a :func:`record_routes` block is open in this thread (a route that costs work to
    describe is described only then). False inside ``torch.compile`` tracing: a traced frame records
    nothing (a side effect Dynamo would have to replay)."""
    return bool(getattr(_local, "stack", None)) and not torch.compiler.is_compiling()


def note_route(route: Route) -> Route:
    """Add ``route`` to every open :func:`record_routes` list of this thread; returns it."""
    stack = getattr(_local, "stack", None)
    if stack:
        for routes in stack:
            routes.append(route)
    return route


def quiet() -> contextlib.AbstractContextManager[None]:
    """Inside the block, :func:`note_route` records nothing: a composite call (the loss) runs its
    primitives without adding their routes to the user's list. Outside every
    :func:`record_routes` block (the common case, once per loss call) a shared no-op context: no
    generator to build and unwind."""
    stack = getattr(_local, "stack", None)
    return _Quiet(stack) if stack else _NOTHING_TO_SILENCE


_NOTHING_TO_SILENCE = contextlib.nullcontext()


class _Quiet:
    """:func:`quiet` while routes are recorded: the thread's open lists set aside for the block."""

    def __init__(self, stack: list[list[Route]]) -> None:
        self._stack = stack
        self._saved: list[list[Route]] = []

    def __enter__(self) -> None:
        self._saved = list(self._stack)
        self._stack.clear()

    def __exit__(self, *exc: object) -> None:
        self._stack[:] = self._saved


# --------------------------------------------------------------------------- primitive routes
def logprobs_route(*, kernels: Kernels, needs_grad: bool) -> Route:
    """The route of ``token_logprobs``: one forward pass over the logits, plus the backward's read
    and write when a gradient is computed (in place or not: the same passes)."""
    passes = None if kernels == "reference" else (3 if needs_grad else 1)
    return Route("logits", "logprobs", kernels, passes=passes)


def linear_route(
    *,
    kernels: Kernels,
    needs_grad: bool,
    gemm: Gemm | None,
    vocab_parallel: bool = False,
    weight_grad: bool = False,
    whole_batch: bool | None = None,
) -> Route:
    """The route of ``linear_token_logprobs``: 1 logits GEMM forward; with a gradient, the backward
    recomputes the logits and runs the dhidden and dweight GEMMs (4 in all). ``whole_batch`` is the
    option of the engine (None: decided from the active row count, ``"auto"``)."""
    if kernels == "reference":
        return Route("hidden", "logprobs", kernels, vocab_parallel=vocab_parallel)
    grouping = None
    if needs_grad and weight_grad and not vocab_parallel:
        grouping = "auto" if whole_batch is None else ("whole-batch" if whole_batch else "grouped")
    return Route(
        "hidden", "logprobs", kernels, passes=4 if needs_grad else 1, gemm=gemm, grouping=grouping,
        vocab_parallel=vocab_parallel,
    )  # fmt: skip
