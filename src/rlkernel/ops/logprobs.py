"""Public log-prob primitives: validate, dispatch to a Triton kernel or the reference.

``token_logprobs`` works from logits; ``linear_token_logprobs`` from the last hidden states and the
LM-head weight without materializing the ``[N, V]`` logits. Both return float32 (float64 for float64
inputs), are differentiable, and give 0 with no gradient where ``token_ids == ignore_index``.
"""

from __future__ import annotations

import contextlib

import torch

from rlkernel import _dispatch
from rlkernel import _validate as check
from rlkernel._autocast import without_autocast
from rlkernel._memo import memoized
from rlkernel._options import Options, current_options
from rlkernel.ops import _dtensor_weight, id_checks
from rlkernel.ops import routes as route_log
from rlkernel.ops.checks import check_common, check_linear_inputs
from rlkernel.reference import logprobs as ref


def _triton_token_logprobs():
    # Imported on first use: importing Triton and registering the custom ops costs ~1 s, and
    # Triton is an optional dependency; the reference path must import without it.
    from rlkernel.ops._logprobs_function import token_logprobs_triton

    return token_logprobs_triton


def _linear_kernel_available(dtype: torch.dtype) -> bool:
    """Whether the GPU linear path handles ``dtype``: fp16, bf16 and fp32 (fp64 has no kernel)."""
    return dtype != torch.float64


@without_autocast
def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    validate: bool = True,
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities (and entropy) from logits.

    ``logp[i] = log_softmax(logits[i] / temperature)[token_ids[i]]`` and
    ``entropy[i] = −Σ_v p_v log p_v`` of the same distribution, both computed in fp32.

    Args:
        logits: ``[..., V]`` float16/bfloat16/float32/float64, any strides (e.g. ``logits[:, :-1]``).
            The Triton path reads views whose leading dims fold into two strided dims without a
            copy; other layouts (e.g. two sliced leading dims) cost one copy of the logits.
        token_ids: ``[...]`` integer ids, the leading shape of ``logits``, in ``[0, V)`` or equal to
            ``ignore_index``.
        temperature: the sampling temperature (> 0); logits are divided by it before the softmax.
        ignore_index: positions with this id give logp = entropy = 0 and get no gradient.
        return_entropy: also return the entropy.
        validate: check that every id is in range; ``False`` skips that check only (it is also
            what makes the call traceable by ``torch.compile(fullgraph=True)``). On the CPU and the
            reference backend the check raises inside the call. On the Triton path on CUDA it costs
            no host sync: a bad id gives a NaN logp at once, and the ``ValueError`` (count, first
            bad id) is raised by the next checking rlkernel call made after the GPU finished this
            one, or by ``rk.raise_pending_errors()`` (waits); see ``docs/api/token_logprobs.md``.
        inplace_backward: Triton path only: write the gradient into the logits' own storage during
            backward instead of a new ``[..., V]`` tensor (saves one logits-sized allocation). The
            logits (and, for a view such as ``logits[:, :-1]``, the tensor it views) are
            overwritten, so neither you nor another autograd node may read them after backward;
            an autograd node that saved them and runs later raises on the version check. A
            backward that retains the graph (``retain_graph=True``) writes out of place, so a
            second backward accumulates the same gradient again; only the last one writes in place
            (torch >= 2.5; older torch cannot tell, writes in place every time, and a second
            backward raises a RuntimeError that says to pass ``inplace_backward=False``). Ignored
            on the reference path (CPU, fp64, ``RLKERNEL_BACKEND=reference``) and inside
            ``torch.compile``, where the out-of-place kernel runs.

    Returns:
        ``logp`` float32 ``[...]``, or ``(logp, entropy)``; float64 for float64 logits.

    Raises:
        TypeError: logits not floating point, token_ids not integer.
        ValueError: shape/device mismatch, temperature <= 0, V == 0, ids out of range.
    """
    check.float_tensor("logits", logits, min_dim=1)
    ids = check_common("logits", logits, token_ids, temperature, ignore_index)
    vocab = logits.shape[-1]
    if vocab < 1:
        raise ValueError(f"logits must have a vocabulary dimension >= 1, got {check.describe(logits)}")
    if validate:
        defer = _dispatch.resolve_backend(logits.device, has_kernel=logits.dtype != torch.float64) == "triton"
        id_checks.check_token_ids("token_ids", ids, vocab, ignore_index, defer=defer)
    return token_logprobs_checked(
        logits,
        ids,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        inplace_backward=inplace_backward,
    )


def token_logprobs_checked(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    inplace_backward: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` on inputs its checks already passed (``ids`` the int tensor they
    returned; a caller that validated them itself, e.g. ``fused_policy_loss``, checks nothing
    twice): dispatch to the Triton path or the reference."""
    # fp64 has no kernel (the kernels accumulate in fp32): it takes the reference under every mode.
    backend = _dispatch.resolve_backend(logits.device, has_kernel=logits.dtype != torch.float64)
    if route_log.recording():
        needs_grad = logits.requires_grad and torch.is_grad_enabled()
        route_log.note_route(route_log.logprobs_route(kernels=backend, needs_grad=needs_grad))
    if backend == "triton":
        logp, entropy = _triton_token_logprobs()(
            logits,
            ids,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            inplace_backward=inplace_backward,
        )
        return (logp, entropy) if return_entropy else logp
    return ref.token_logprobs(
        logits, ids, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy
    )


@without_autocast
def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    tp_group: object | None = None,
    validate: bool = True,
    invariant: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities (and entropy) straight from hidden states and the LM head.

    Same result as ``token_logprobs(hidden @ weight.T + bias, token_ids, ...)`` with the logits in
    fp32, but the ``[N, V]`` logits never exist at once: they are produced one bounded chunk of rows
    at a time (see :func:`rlkernel.reference.logprobs.chunk_rows_for`) in forward and recomputed in
    backward.

    With ``invariant=True`` the result is bitwise ``token_logprobs(lm_head(hidden), token_ids, ...)``
    (same temperature; the entropy too) for the LM head of a model patched by
    ``rlkernel.invariant.patch_hf_model``: each chunk's logits come from the same batch-invariant
    GEMM as that LM head (same kernel and configuration table, same rounding to ``logits_dtype``),
    and the log-softmax is ``token_logprobs``'s own. A row's result depends on nothing but that
    row, so the log-probs a rollout engine got from the patched model at any decode batch size are
    reproduced exactly, without materializing the logits.

    Args:
        hidden: ``[..., H]`` float, the policy's last hidden states (a DTensor: ``Replicate()``
            only, its local tensor is used).
        weight: ``[V, H]`` LM-head weight, same dtype and device as ``hidden``. Gradients for it are
            computed only when ``weight.requires_grad``. A ``DTensor`` (FSDP2's ``fully_shard``:
            ``Shard(0)``; or ``Replicate()``) is gathered to the full weight, its gradient averaged
            over the mesh into the sharded ``weight.grad``; float32 shards with float16/bfloat16
            ``hidden`` are gathered in ``hidden``'s dtype (see :mod:`rlkernel.ops._dtensor_weight`).
        token_ids: ``[...]`` integer ids, the leading shape of ``hidden``.
        bias: optional ``[V]`` LM-head bias (a DTensor as ``weight``).
        temperature, ignore_index, return_entropy, validate: as in :func:`token_logprobs`.
        tp_group: vocab-parallel process group: ``weight`` (and ``bias``) are this rank's contiguous
            vocabulary shard, shards in rank order, uneven sizes allowed; ``hidden`` and
            ``token_ids`` are replicated. Every rank gets the full-vocabulary logp/entropy. See
            :func:`rlkernel.distributed.vocab_parallel_linear_token_logprobs`.
        invariant: reproduce a patched LM head's log-probs bit for bit (above). The backward is
            the usual one (fp32 accumulation, deterministic, not batch invariant), at the logits
            the forward used. Not with ``tp_group``.
        logits_dtype: with ``invariant=True`` only: the dtype of the patched LM head's logits.
            None or ``hidden.dtype``: ``patch_hf_model(model)`` (bf16 logits for a bf16 model);
            ``torch.float32``: ``patch_hf_model(model, lm_head_dtype=torch.float32)``. (Without
            ``invariant`` the chunk logits' dtype is the option ``linear_logits_dtype``.)

    Returns:
        ``logp`` float32 ``[...]``, or ``(logp, entropy)``; float64 for float64 inputs.

    Raises:
        TypeError: as :func:`token_logprobs`; ``weight`` (or, with ``invariant``, ``bias``) of
            another dtype than ``hidden``; ``invariant`` not a bool.
        ValueError: as :func:`token_logprobs`; ``weight``/``bias`` shapes; ``invariant`` with
            ``tp_group``; ``logits_dtype`` without ``invariant`` or not one of the above; a
            DTensor with ``tp_group``, a DTensor ``weight``/``bias`` placement other than
            ``Shard(0)``/``Replicate()``, a DTensor ``hidden`` not replicated.
    """
    # FSDP2: a DTensor weight (outside the module's forward) is gathered to the full [V, H] head.
    hidden, weight, bias = _dtensor_weight.local_lm_head(hidden, weight, bias, tp_group=tp_group)
    inv_dtype = invariant_logits_dtype(invariant, logits_dtype, hidden, bias, tp_group)
    if tp_group is not None:
        # Vocab-parallel: every local check, the shard layout and the id range (of the *global*
        # vocabulary) are validated there across ranks, so that every rank raises the same error
        # (a check failing here on one rank only would leave the others waiting in a collective).
        from rlkernel.ops.vocab_parallel import vocab_parallel_linear_token_logprobs

        if route_log.recording():
            has_kernel = _linear_kernel_available(hidden.dtype)
            backend = _dispatch.resolve_backend(hidden.device, has_kernel=has_kernel)
            needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
            route_log.note_route(route_log.linear_route(kernels=backend, needs_grad=needs_grad, gemm=None,
                                                        vocab_parallel=True))  # fmt: skip
        return vocab_parallel_linear_token_logprobs(
            hidden,
            weight,
            token_ids,
            tp_group=tp_group,
            validate=validate,
            bias=bias,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
        )
    ids = check_linear_inputs(hidden, weight, token_ids, bias, temperature, ignore_index)
    checked = contextlib.nullcontext()
    if validate:
        backend = _dispatch.resolve_backend(hidden.device, has_kernel=_linear_kernel_available(hidden.dtype))
        # Deferred (Triton): queued after the forward's kernels, so it does not delay the first GEMM
        # (the kernels read a bad id safely: a NaN log-prob until the check's error is raised).
        checked = id_checks.token_ids_checked(
            "token_ids", ids, weight.shape[0], ignore_index, defer=backend == "triton"
        )
    with checked:
        return linear_token_logprobs_checked(
            hidden, weight, ids, bias=bias, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy, invariant_logits=inv_dtype,
        )  # fmt: skip


def invariant_logits_dtype(
    invariant: object,
    logits_dtype: object,
    hidden: object,
    bias: object = None,
    tp_group: object = None,
) -> torch.dtype | None:
    """The checked ``invariant``/``logits_dtype`` pair of the linear path: None (not invariant),
    or the dtype of the patched LM head's logits to reproduce (``hidden``'s, or ``torch.float32``).

    Raises:
        TypeError: ``invariant`` not a bool; with ``invariant``, a ``bias`` of another dtype than
            ``hidden`` (the patched LM head takes no such bias).
        ValueError: ``logits_dtype`` without ``invariant``, or not None / ``hidden.dtype`` /
            ``torch.float32`` (the latter for float16/bfloat16/float32 hidden states);
            ``invariant`` with ``tp_group``.
    """
    check.boolean("invariant", invariant)
    if not invariant:
        if logits_dtype is not None:
            raise ValueError(
                f"logits_dtype applies with invariant=True only, got logits_dtype={logits_dtype!r} "
                "(the non-invariant path's chunk logits dtype is the option linear_logits_dtype)"
            )
        return None
    if tp_group is not None:
        raise ValueError(
            "invariant=True is not supported with tp_group: the patched LM head is one unsharded "
            "GEMM, and a vocabulary-sharded log-softmax sums in another order"
        )
    check.float_tensor("hidden", hidden, min_dim=1)
    dtype = hidden.dtype if logits_dtype is None else logits_dtype
    half_or_fp32 = hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if dtype is not hidden.dtype and not (dtype is torch.float32 and half_or_fp32):
        raise ValueError(
            "logits_dtype must be None or hidden.dtype (the logits of patch_hf_model(model)) or "
            "torch.float32 (patch_hf_model(model, lm_head_dtype=torch.float32)) for float16/"
            f"bfloat16/float32 hidden states; got {logits_dtype!r} with hidden {hidden.dtype}"
        )
    if isinstance(bias, torch.Tensor) and bias.dtype != hidden.dtype:
        raise TypeError(
            f"with invariant=True, bias dtype {bias.dtype} must match hidden dtype {hidden.dtype} "
            "(as the patched LM head requires)"
        )
    return dtype


def linear_token_logprobs_checked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    invariant_logits: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_token_logprobs` (single GPU) on inputs :func:`check_linear_inputs` already
    passed: dispatch to the Triton chunk engine or the reference. ``invariant_logits``: the
    checked :func:`invariant_logits_dtype` (None: not invariant)."""
    backend = _dispatch.resolve_backend(hidden.device, has_kernel=_linear_kernel_available(hidden.dtype))
    if route_log.recording():
        grad_on = torch.is_grad_enabled()
        needs_grad = grad_on and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        gemm = "invariant" if invariant_logits is not None else None
        if backend == "triton" and gemm is None:
            gemm = linear_gemm_kind(hidden, weight, bias, current_options())
        route_log.note_route(route_log.linear_route(
            kernels=backend, needs_grad=needs_grad, gemm=gemm, weight_grad=grad_on and weight.requires_grad,
        ))  # fmt: skip
    if backend == "triton":
        from rlkernel.ops._linear_function import linear_token_logprobs_triton

        return linear_token_logprobs_triton(
            hidden, weight, ids, bias=bias, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy, invariant_logits=invariant_logits,
        )  # fmt: skip
    return ref.linear_token_logprobs(
        hidden,
        weight,
        ids,
        bias=bias,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        invariant_logits=invariant_logits,
    )


def linear_gemm_kind(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, options: Options
) -> str:
    """The logits GEMM the chunk engine runs for these (non-invariant) inputs under ``options``:
    ``"epilogue"`` (the Triton LM-head GEMM with the log-softmax statistics in its epilogue) or
    ``"cublas"`` (cuBLAS chunks and the log-prob kernels). The engine's own rule, memoized on what
    it reads (dtypes, devices, the weight's layout and alignment, bias presence, the options):
    ~0.13 ms per call on the H100 host otherwise (settings, TMA and capability probes)."""
    key = (
        hidden.dtype, hidden.device, weight.dtype, weight.device, weight.dim(), tuple(weight.stride()),
        weight.is_contiguous(), weight.data_ptr() % 16, bias is None, options,
    )  # fmt: skip
    return memoized(_GEMM_KIND, key, lambda: _gemm_kind(hidden, weight, bias, options))


_GEMM_KIND: dict = {}


def _gemm_kind(hidden, weight, bias, options: Options) -> str:
    from rlkernel.ops._linear_engine import EngineSettings, gemm_backend

    return gemm_backend(hidden, weight, bias, EngineSettings.from_options(options)).backend
