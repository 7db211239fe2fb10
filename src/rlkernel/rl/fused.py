"""``fused_policy_loss``: the RL loss straight from logits, or from hidden states and the LM head.

    logp (, entropy) = token_logprobs(logits, ids)            or linear_token_logprobs(hidden, W, ids)
    out              = policy_loss(logp, old_logp, advantages, mask, cfg, entropy=entropy, ...)

It is a composition of the log-prob primitives (:mod:`rlkernel.ops.logprobs`) and the loss
algebra (:mod:`rlkernel.rl.loss`): the memory-lean part — never holding fp32 ``[N, V]`` copies, or the
logits at all on the hidden-state path — is the primitives' job.

Every input is checked once, in :mod:`rlkernel.rl._fused_call` (a repeat of an earlier plain logits
call takes that call's decision instead: :mod:`rlkernel.rl.repeat_calls`). Which code runs is the
call's route (:mod:`rlkernel.rl.routes`: one pure choice; ``ROUTES`` below maps each route to its
builder; ``out.route`` says which ran; docs/api/routes.md):

* Token-level objectives from logits on the Triton backend (``rlkernel.rl.token_loss.is_eligible``:
  ppo, cispo, sapo, reinforce with any aggregation, KL, entropy and rollout correction): the
  ``[B, T]`` algebra does not run under autograd. A padded batch without rollout corrections takes
  the device-built plan (``ops.device_plan_loss``: mask counts + one row kernel forward, one launch
  backward); the rest a plan of per-token constants built with torch ops (log-prob kernel, plan,
  token-loss kernel; one backward launch). For V <= the option ``grad_in_forward_max_vocab``
  (262,144 by default; 0 turns it off), when the logits require grad and ``inplace_backward`` is
  off, the gradient is written during the forward (2 passes over the logits) and the backward only
  rescales it. Inside ``torch.compile``: one registered custom op.
* Every other objective from logits on the Triton backend with a gradient to compute: the same two
  log-prob kernels and, between them, the loss's per-token coefficients — for gspo, gspo_token and
  gmpo (``rl.seq_token_loss.is_eligible``, not under ``cp_group``) in closed form in ONE Triton
  launch (a padded batch without rollout corrections: the plan built on the device as well,
  ``ops.device_seq_plan``: mask counts + row kernel + sequence kernel); for the rest (vespo,
  dppo, clip_cov, kl_cov, dro, ratio-weighted KL, OPSM/entropy masks, gmpo with rollout weights)
  by the ``[B, T]`` algebra of ``policy_loss`` differentiated by autograd inside the forward
  (``_logits_autograd``, ~100 small launches).
* Token-level objectives from hidden states: the fused chunk engine (3 GEMMs with a gradient).
* Everything else (the hidden path of other objectives, ``tp_group``, fp64, the reference backend,
  ``token_level_fusion=False``): the composed path. All give the same loss, gradients (to fp32
  rounding) and metrics.

Masked positions are sent to the primitive as ``ignore_index`` (their ids may be garbage such as -1 or
a pad id out of the vocabulary), so they cost no softmax gradient and need no valid id. Entropy is
computed only when ``cfg.entropy_coef != 0`` or ``cfg.top_entropy_quantile < 1``. ``old_logp=None``
(on-policy) costs no second pass: the composed path reads the detached log-probs of this call, the
token-level kernels their own (``HAS_OLD=False``). Off-policy sequence masks, entropy quantiles and
on-policy rollout corrections/rejection keep the composed path (``token_loss.is_eligible``).

Caveats:
    * The caller aligns logits with ids (``logits[:, :-1]`` predicts ``ids[:, 1:]``); strided views
      are fine.
    * ``cp_group`` (context parallelism, :mod:`rlkernel.rl.context_parallel`): the token-level
      plan's per-token constants come from sums reduced over the group (the host-built plan: the
      device-built one counts one rank's mask); gspo, gspo_token and gmpo from logits take the
      autograd coefficients, never the closed-form sequence kernel (it sums each sequence in one
      program and cannot see the other ranks' tokens); the linear path builds its plan before the
      first chunk (its collectives must run on a rank without a chunk too).
    * ``tp_group`` (vocab-parallel LM head) is forwarded to ``linear_token_logprobs`` and works only
      on the hidden-state path. A DTensor LM head (FSDP2) is gathered first
      (``rlkernel.ops._dtensor_weight``), not with ``tp_group``.
    * Inside ``torch.compile`` a token-level objective's logits path is one registered custom op
      (``rlkernel::token_loss_from_logits``, 3 passes); the coefficient path, the
      gradient-in-forward route and the hidden-state chunk engine are eager-only (the composed path
      is traced for them). The id check is eager-only: pass ``validate=False`` under
      ``fullgraph=True``.
    * The fused paths' backward is not itself differentiable (no ``create_graph`` double backward).
    * With ``validate=True`` on CUDA (Triton path) the id check is queued after the loss's kernels
      and read later (``rlkernel.ops.id_checks``): no host sync.
"""

from __future__ import annotations

import contextlib

import torch

from rlkernel._autocast import without_autocast
from rlkernel.ops import id_checks
from rlkernel.ops import routes as route_log
from rlkernel.ops.logprobs import (
    linear_token_logprobs,
    linear_token_logprobs_checked,
    token_logprobs_checked,
)
from rlkernel.ops.routes import Route
from rlkernel.ops.token_loss import IGNORE_INDEX, LossCoefficients, TokenLossTerms
from rlkernel.ops.token_loss import token_loss as token_loss_op
from rlkernel.rl import seq_token_loss, token_loss
from rlkernel.rl._fused_call import CheckedCall, checked_call
from rlkernel.rl.batch import LossBatch
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.loss import PolicyLossOutput, loss_from_batch


def _wants_entropy(cfg: PolicyLossConfig) -> bool:
    """Whether the loss reads the entropy: an entropy term, or the top-entropy-quantile mask."""
    return cfg.entropy_coef != 0 or cfg.top_entropy_quantile < 1


@without_autocast
def fused_policy_loss(
    cfg: PolicyLossConfig,
    *,
    token_ids: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    rollout_weights: torch.Tensor | None = None,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    tp_group: object | None = None,
    cu_seqlens: torch.Tensor | None = None,
    validate: bool = True,
    inplace_backward: bool = False,
    invariant: bool = False,
    logits_dtype: torch.dtype | None = None,
    cp_group: object | None = None,
    cp_positions: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The RL loss from logits or hidden states; same result as ``policy_loss(token_logprobs(...))``.

    Args:
        cfg: the objective (:class:`PolicyLossConfig`).
        token_ids: int ``[B, T]`` (or packed ``[N]``), the sampled tokens aligned with the logits;
            any value (e.g. -1, a pad id) at masked positions.
        old_logp, advantages, mask, ref_logp, rollout_logp, rollout_weights, global_tokens,
            global_seqs, cu_seqlens: as in :func:`rlkernel.policy_loss`, over the shape of
            ``token_ids``. ``old_logp=None`` (on-policy) uses the log-probs this call computes,
            detached: no second log-prob pass.
        logits: ``[B, T, V]`` (or ``[N, V]``) float logits. Exactly one of ``logits`` and ``hidden``.
        hidden: ``[B, T, H]`` (or ``[N, H]``) last hidden states, with ``weight`` ``[V, H]`` and an
            optional ``bias`` ``[V]``. A DTensor ``weight``/``bias`` (FSDP2) is gathered as in
            :func:`rlkernel.linear_token_logprobs`.
        temperature: the sampling temperature (> 0) applied to the logits.
        tp_group: vocab-parallel process group (hidden path only; see ``linear_token_logprobs``).
        cp_group, cp_positions: context parallelism, as in :func:`rlkernel.policy_loss` (each rank
            holds a slice of the token positions of every sequence: ``token_ids``, the logits or
            hidden states and every per-token input are this rank's slice). With ``tp_group``
            too, the ranks of one TP group hold the same slice. A collective: every rank of
            ``cp_group`` makes the call, runs the backward and reads the metrics (or none does).
            Under ``cp_group`` the id check (``validate``) and every input check run inside one
            cross-rank check: any rank's error is raised on every rank.
        validate: check that active ids are in ``[0, V)``; ``False`` skips it. No host sync on the
            Triton path on CUDA: a bad id makes the loss NaN at once and its ``ValueError`` is
            raised by a later call (see ``token_logprobs``'s ``validate``); elsewhere it raises
            inside the call.
        inplace_backward: logits path only: the backward writes dL/dlogits into the logits' own
            storage (see :func:`rlkernel.token_logprobs`), so the step needs no memory for the
            gradient; the logits must not be used after the backward.
        invariant, logits_dtype: hidden path only: the log-probs (and entropy) are bitwise those
            ``token_logprobs`` gives for the logits of the LM head of a model patched by
            ``rlkernel.invariant.patch_hf_model`` (with ``lm_head_dtype=logits_dtype``); see
            :func:`rlkernel.linear_token_logprobs`. Not with ``tp_group``.

    Returns:
        :class:`PolicyLossOutput`; the loss is differentiable in ``logits`` or ``hidden``/``weight``/
        ``bias``; ``out.route`` is the :class:`~rlkernel.ops.routes.Route` the call took (chosen by
        :func:`rlkernel.rl.routes.choose_route`).

    Raises:
        TypeError: wrong dtypes or types (as the primitives and ``policy_loss`` do), ``validate``
            or ``inplace_backward`` not a bool.
        ValueError: both or neither of ``logits``/``hidden``, ``weight`` missing with ``hidden``,
            ``weight``/``bias``/``tp_group`` with ``logits``, shape/device mismatches, active ids
            out of range, the DTensor cases ``linear_token_logprobs`` rejects, and everything
            ``policy_loss`` rejects.
    """
    call, route, compiling = checked_call(
        cfg, token_ids=token_ids, old_logp=old_logp, advantages=advantages, mask=mask, logits=logits,
        hidden=hidden, weight=weight, bias=bias, temperature=temperature, ref_logp=ref_logp,
        rollout_logp=rollout_logp, rollout_weights=rollout_weights, global_tokens=global_tokens,
        global_seqs=global_seqs, tp_group=tp_group, cu_seqlens=cu_seqlens, validate=validate,
        inplace_backward=inplace_backward, invariant=invariant, logits_dtype=logits_dtype,
        cp_group=cp_group, cp_positions=cp_positions,
    )  # fmt: skip
    return _run(route, call, compiling=compiling)


def _run(route: Route, call: CheckedCall, *, compiling: bool) -> PolicyLossOutput:
    """Run ``route``'s builder on a checked call; ``out.route`` says which."""
    if compiling:  # no recording (a thread-local side effect) in a traced frame
        out = ROUTES[route.key](route, call)
    else:
        route_log.note_route(route)
        with route_log.quiet():  # the primitives a route runs do not add their own routes
            out = ROUTES[route.key](route, call)
    out.route = route
    return out


# -------------------------------------------------------------------------------- the builders
ID_WHAT = "token_ids (at active mask positions)"  # the argument the id check's error names


def _masked(call: CheckedCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, active)``: the masked ids of a host-plan or composed route (one launch on Triton)."""
    return token_loss.masked_token_ids(call.token_ids, call.batch.mask)


def _id_check(call: CheckedCall, route: Route, active: torch.Tensor):
    """The id check around a route's launches (active positions only, none exempt: an active id
    equal to IGNORE_INDEX is an error, sent to the kernels as -1: a NaN log-prob meanwhile):
    deferred after the kernels on the Triton kernels, before them elsewhere. The vocab-parallel
    primitive checks the ids itself, across ranks; under ``cp_group`` they were checked inside the
    cross-rank check."""
    if not call.validate or call.tp_group is not None or call.batch.cp is not None:
        return contextlib.nullcontext()
    return id_checks.token_ids_checked(
        ID_WHAT, call.token_ids, call.vocab, None,
        defer=route.kernels != "reference", active=active,
    )  # fmt: skip


def _composed(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """The primitive (log-probs, and entropy when the loss reads it), then ``policy_loss``'s
    algebra under autograd."""
    ids, active = _masked(call)
    want_entropy = _wants_entropy(call.cfg)
    common = dict(temperature=call.temperature, ignore_index=IGNORE_INDEX, return_entropy=want_entropy)
    with _id_check(call, route, active):
        if call.logits is not None:
            out = token_logprobs_checked(call.logits, ids, inplace_backward=call.inplace_backward, **common)
        elif call.tp_group is None:
            out = linear_token_logprobs_checked(
                call.hidden, call.weight, ids, bias=call.bias, invariant_logits=call.invariant_logits,
                **common,
            )  # fmt: skip
        else:
            # The vocab-parallel primitive checks the ids against the *global* vocabulary on every
            # rank at once (a local check against this rank's shard would reject valid ids, on some
            # ranks only); negative active ids arrive there as -1 (masked_token_ids), out of range.
            out = linear_token_logprobs(
                call.hidden, call.weight, ids, bias=call.bias, tp_group=call.tp_group,
                validate=call.validate, **common,
            )  # fmt: skip
    logp, entropy = out if want_entropy else (out, None)
    return loss_from_batch(logp, entropy, call.batch)


def _logits_token_device(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """A token-level loss from logits whose constants the kernels build (mask counts + one row
    kernel; ``ops.device_plan_loss``); metrics stay lazy."""
    from rlkernel.ops.device_plan_loss import token_loss_device_plan

    plan = token_loss.device_plan_from_batch(call.batch, call.token_ids, check_ids=call.validate)
    loss, logp, entropy = token_loss_device_plan(
        call.logits, plan, temperature=call.temperature, inplace_backward=call.inplace_backward,
        two_pass=route.passes == 2,
    )  # fmt: skip
    # flat [S·T]: the metrics (lazy) view them as the batch's tokens, no view op per call
    return _output(loss, logp, entropy if plan.want_entropy else None, call.batch, flat=True)


def _logits_token_host(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """A token-level loss from logits with a host-built plan: 2 passes (the gradient written during
    the forward) or 3 (log-prob kernel, plan, token-loss kernel; one backward launch)."""
    from rlkernel.ops import _logprobs_function as fn

    masked = _masked(call)
    batch, logits, temperature = call.batch, call.logits, call.temperature
    want_entropy = batch.cfg.entropy_coef != 0
    with _id_check(call, route, masked[1]):
        if route.passes == 2:  # the row kernel reads the plan: build it first
            plan = token_loss.plan_from_batch(batch, masked)
            loss, logp, entropy = fn.token_loss_grad_in_forward_triton(logits, plan, temperature=temperature)
            return _output(loss, logp, entropy if want_entropy else None, batch)

        def terms(rows, logp, entropy):  # rows: every token (ops.token_loss.CoefFn)
            # Built here, after the log-prob kernel was queued: the plan's ~20 small launches of
            # host time overlap that kernel instead of delaying it.
            plan = token_loss.plan_from_batch(batch, masked)
            return token_loss_op(plan, logp, entropy, backend="triton")

        source = LossCoefficients(masked[0].reshape(-1), IGNORE_INDEX, want_entropy, terms)
        loss, logp, entropy = fn.token_loss_triton(
            logits, source, temperature=temperature, inplace_backward=call.inplace_backward
        )
    return _output(loss, logp, entropy if want_entropy else None, batch)


def _logits_token_compiled(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """A token-level loss from logits inside ``torch.compile``: the plan's torch ops are traced, the
    kernels are one registered custom op (``rlkernel::token_loss_from_logits``); metrics lazy."""
    from rlkernel.ops import _logprobs_function as fn

    masked = _masked(call)
    with _id_check(call, route, masked[1]):
        plan = token_loss.plan_from_batch(call.batch, masked)
        loss, logp, entropy = fn.token_loss_traced(call.logits, plan, temperature=call.temperature)
    return _output(loss, logp, entropy if plan.want_entropy else None, call.batch)


def _logits_sequence_device(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """gspo, gspo_token, gmpo from logits with the plan built on the device (mask counts, one row
    kernel, one sequence kernel; ``ops.device_seq_plan``); metrics stay lazy."""
    from rlkernel.ops.device_seq_plan import seq_loss_device_plan

    plan = seq_token_loss.device_seq_plan(call.batch, call.token_ids, check_ids=call.validate)
    loss, logp, entropy = seq_loss_device_plan(
        call.logits, plan, temperature=call.temperature, inplace_backward=call.inplace_backward
    )
    lead = call.batch.token_shape
    return _output(loss, logp.view(lead), entropy.view(lead) if plan.want_entropy else None, call.batch)


def _logits_sequence(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """gspo, gspo_token, gmpo from logits: the two log-prob kernels with the closed-form sequence
    coefficients of :mod:`rlkernel.rl.seq_token_loss` between them (a few dozen small launches, no
    autograd); metrics stay lazy."""
    from rlkernel.ops import _logprobs_function as fn

    masked = _masked(call)
    batch = call.batch
    want_entropy = batch.cfg.entropy_coef != 0
    def terms(rows, logp, entropy):  # rows: every token (ops.token_loss.CoefFn)
        return seq_token_loss.seq_terms(batch, masked, logp, entropy)

    source = LossCoefficients(masked[0].reshape(-1), IGNORE_INDEX, want_entropy, terms)
    with _id_check(call, route, masked[1]):
        loss, logp, entropy = fn.token_loss_triton(
            call.logits, source, temperature=call.temperature, inplace_backward=call.inplace_backward
        )
    return _output(loss, logp, entropy if want_entropy else None, batch)


def _logits_autograd(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """Any objective from logits in two log-prob kernels (Fast-LLM's GSPO design, for every loss):
    the forward kernel's per-token statistics, the ``[B, T]`` algebra differentiated by autograd
    *inside the forward* (dL/dlogp, dL/dH per token: the sequence coupling of gspo, gspo_token and
    gmpo lives only here), and one backward kernel with those coefficients. Same algebra as
    ``policy_loss`` (the loss and its gradients to fp32 rounding); metrics stay lazy."""
    from rlkernel.ops import _logprobs_function as fn

    masked = _masked(call)
    batch = call.batch
    want_entropy = _wants_entropy(batch.cfg)
    composed = []  # the algebra's output: its metrics are the ones of the loss's own run (clip_cov's
    # random token draw, say, is not drawn again for them)

    def terms(rows, logp, entropy):  # rows: every token (ops.token_loss.CoefFn)
        with torch.enable_grad():
            stats = [logp.detach().requires_grad_()]
            if want_entropy:
                stats.append(entropy.detach().requires_grad_())
            composed.append(loss_from_batch(stats[0], stats[1] if want_entropy else None, batch))
            loss = composed[0].loss
            if loss.requires_grad:
                grads = torch.autograd.grad(loss, stats, allow_unused=True, materialize_grads=True)
            else:  # a loss that reads no log-prob (every token masked): zero coefficients
                grads = [torch.zeros_like(t) for t in stats]
        flat = [g.reshape(-1).to(torch.float32) for g in grads]
        return TokenLossTerms(loss.detach(), flat[0], flat[1] if want_entropy else None)

    source = LossCoefficients(masked[0].reshape(-1), IGNORE_INDEX, want_entropy, terms)
    with _id_check(call, route, masked[1]):
        loss, _, _ = fn.token_loss_triton(
            call.logits, source, temperature=call.temperature, inplace_backward=call.inplace_backward
        )
    return PolicyLossOutput(loss, compute_metrics=lambda: composed[0].metrics)


def _hidden_token(route: Route, call: CheckedCall) -> PolicyLossOutput:
    """The eligible-config hidden-state path: the plan's per-chunk coefficients drive the chunk
    engine, which forms dL/dlogits while each chunk's logits are live; metrics stay lazy."""
    from rlkernel.ops import _linear_rows as linear_rows  # (imports the kernels: not at module level)
    from rlkernel.ops._linear_function import fused_linear_token_loss

    batch = call.batch
    want_entropy = batch.cfg.entropy_coef != 0
    # The id masking, padding compaction and the id check in one launch and one host read (the
    # compaction's count with the check's two numbers), nothing host-bound before it; the plan is
    # built lazily, on the first chunk's coefficients (below). Not with rollout rejection (the plan's
    # ids drop tokens) or context parallelism (the plan's collectives first, on every rank).
    rows = None
    if batch.cfg.rollout_rs is None and batch.cp is None:
        check_ids = call.validate and call.tp_group is None
        rows = linear_rows.masked_active_rows(
            call.token_ids, batch.mask, call.hidden, IGNORE_INDEX, call.vocab, check=check_ids
        )
    if rows is not None:
        if check_ids:
            defer = call.token_ids.is_cuda  # as _id_check: deferred on CUDA, raised here elsewhere
            if rows.bad and not defer:  # the exact message (the kernel's first id is clamped to int32)
                id_checks.check_token_ids(ID_WHAT, call.token_ids, call.vocab, None, defer=False,
                                          active=rows.active)  # fmt: skip
            id_checks.report_read(ID_WHAT, rows.bad, rows.first_key, call.vocab, None, defer=defer)
        masked = (rows.ids, rows.active)  # (flat ids: the plan reads them flat)
        outs = fused_linear_token_loss(
            call.hidden, call.weight, call.bias, rows.ids, coef_fn=_lazy_coef_fn(batch, masked),
            temperature=call.temperature, ignore_index=IGNORE_INDEX, with_entropy=want_entropy,
            invariant_logits=call.invariant_logits, compaction=rows.compaction,
        )  # fmt: skip
        return _output(outs[0], outs[1], outs[2] if want_entropy else None, batch)
    masked = _masked(call)
    if batch.cfg.rollout_rs is None and batch.cp is None:
        # The plan's ids are the masked ids: build the plan (~20 small launches of host time) on the
        # first chunk's coefficients, after that chunk's logits GEMM was queued, instead of before
        # it, while the GPU would wait. (Context parallelism: its collectives must run on every
        # rank, also one without a chunk: the plan first.)
        ids, coef_fn = masked[0].reshape(-1), _lazy_coef_fn(batch, masked)
    else:  # rollout rejection drops tokens from the ids: the plan first
        plan = token_loss.plan_from_batch(batch, masked)
        ids, coef_fn = plan.ids, token_loss.as_coef_fn(plan)
    with _id_check(call, route, masked[1]):
        outs = fused_linear_token_loss(
            call.hidden, call.weight, call.bias, ids, coef_fn=coef_fn, temperature=call.temperature,
            ignore_index=IGNORE_INDEX, with_entropy=want_entropy, invariant_logits=call.invariant_logits,
        )  # fmt: skip
    entropy = outs[2] if want_entropy else None
    return _output(outs[0], outs[1], entropy, batch)


# The one table from a route to the code that runs it (``Route.key``: source, objective, kernels, plan).
ROUTES = {
    ("logits", "token", "triton", "device"): _logits_token_device,
    ("logits", "token", "triton", "host"): _logits_token_host,
    ("logits", "token", "compiled", "host"): _logits_token_compiled,
    ("logits", "sequence", "triton", "device"): _logits_sequence_device,
    ("logits", "sequence", "triton", "host"): _logits_sequence,
    ("logits", "autograd", "triton", None): _logits_autograd,
    ("hidden", "token", "triton", "host"): _hidden_token,
    **{(source, "composed", kernels, None): _composed
       for source in ("logits", "hidden") for kernels in ("triton", "reference", "compiled")},  # fmt: skip
}


def _output(loss, logp, entropy, batch: LossBatch, flat: bool = False) -> PolicyLossOutput:
    """The fused result with lazy metrics: the composed algebra on the detached log-probs, so the
    metrics equal the composed path's (``flat``: ``logp``/``entropy`` ``[S·T]``, viewed as the
    batch's tokens only when the metrics are read)."""

    def metrics():
        lp, en = logp, entropy
        if flat:
            lp, en = lp.view(batch.token_shape), None if en is None else en.view(batch.token_shape)
        return loss_from_batch(lp, en, batch).metrics

    return PolicyLossOutput(loss, compute_metrics=metrics)


def _lazy_coef_fn(batch, masked_ids):
    """``token_loss.as_coef_fn`` of the batch's plan, the plan built on the first call."""
    built = []

    def coef_fn(rows, logp, entropy):
        if not built:
            built.append(token_loss.as_coef_fn(token_loss.plan_from_batch(batch, masked_ids)))
        return built[0](rows, logp, entropy)

    return coef_fn
