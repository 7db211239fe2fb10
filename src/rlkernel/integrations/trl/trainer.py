"""``RLKernelGRPOTrainer``: TRL 1.16's ``GRPOTrainer`` whose loss is rlkernel's, from hidden states.

    from rlkernel.integrations.trl import RLKernelGRPOTrainer   # instead of trl.GRPOTrainer

Same constructor (plus ``true_on_policy``, below), generation, rewards, advantages, old and
reference log-probs (TRL's own code); ``_compute_loss`` changes. TRL's computes the per-token
log-probs with its fused LM head and then the loss on ``[B, T]`` tensors; this one runs the
backbone, takes the last hidden states of the completion positions and the LM-head weight, and
computes the loss with

    otherwise                  rk.fused_policy_loss(cfg, old_logp=old or None, hidden=h, weight=W, ...)
    an entropy bonus, or OPSM  logp, H = rk.linear_token_logprobs(h, W, ids, return_entropy=True)
                               rk.policy_loss(logp, old or None, entropy=H, ...) − coef·mean_e(H)/GA

Neither materializes the ``[B, T, V]`` logits. ``old_logp=None`` is TRL's on-policy case (its default:
``old_per_token_logps`` is None and the ratio is exp(logp − sg[logp])), exact and in one LM-head pass.
The second route serves TRL's entropy bonus, the token mean of the entropy over the kept tokens e
(all of them, or the top-entropy ones with ``top_entropy_quantile < 1``), not a policy aggregation,
and TRL's OPSM on vLLM's log-probs without the vLLM correction (a token vLLM could not score counts
as no drift: ŝ = sg[logp] there, known only after the pass).

The completion tokens are packed (``cu_seqlens``): padding and tool-masked positions never reach the
LM head. ``cfg`` and the normalizers come from :mod:`rlkernel.integrations.trl.config`; the mapping
is decided in ``__init__``, which raises ``ValueError`` naming the setting it cannot reproduce.

Metrics logged (TRL's names): ``kl``, ``clip_ratio/{low,high,region}_mean`` (ppo / gspo losses),
``cispo_clip_ratio``, ``entropy`` (entropy-bonus route only: the fused path does not return the
entropy), ``policy_loss`` and ``entropy_coef`` (with the bonus). Not logged: ``clip_ratio/low_min`` and
``clip_ratio/high_max`` (per-sequence extremes), ``entropy`` on the fused path, ``vespo/phi_seq_mean``
(rlkernel's ``vespo_phi_mean`` is a token mean, TRL's a mean over the rows).

The sampler's log-probs (without vLLM, TRL's one ``model.generate`` call per batch): TRL's
generation is wrapped (``_generate_single_turn``) to keep them (:class:`SamplerLogprobs`), the batch
carries them as ``sampler_per_token_logps``, and the loss pass of every micro-batch trained at the
weights that sampled it compares its own log-probs with them (one no-grad LM-head pass on the fused
route), logged once per optimizer step under TRL's vLLM names ``sampling/sampling_logp_difference/
{mean,max}`` and ``sampling/importance_sampling_ratio/{min,mean,max}``: the mismatch a user of the
stock trainer has today.

``true_on_policy=True`` (:mod:`rlkernel.integrations.trl.on_policy`): the policy is patched with
``patch_hf_model``, the loss forward gets ``generate()``'s positions and the LM-head ops
``invariant=True``, so the comparison above reads exactly 0 and 1; where TRL would score old
log-probs (``_get_per_token_logps_and_entropies`` from ``_generate_and_score_completions``, when
``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation × num_iterations``), that
call returns the sampler's log-probs without a forward. The reference model's pass (``beta > 0``)
is TRL's.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from trl import GRPOTrainer

from rlkernel import _validate as check
from rlkernel import fused_policy_loss, linear_token_logprobs, policy_loss
from rlkernel.integrations.trl import on_policy
from rlkernel.integrations.trl.config import (
    TRLLossPlan,
    plan_from_trl,
    require_supported_trl,
    step_normalizers,
)
from rlkernel.integrations.trl.head import (
    HeadSettings,
    add_rlkernel_lm_head,
    head_inputs,
    head_settings,
    install_loss_head,
    policy_model,
)
from rlkernel.integrations.trl.sampler import (
    SamplerLogprobs,
    combine_totals,
    metrics_from_totals,
    mismatch_totals,
)

__all__ = ["RLKernelGRPOTrainer"]

# Loss types whose TRL loss is divided by the accumulation steps after its policy_loss metric is taken.
_PER_WINDOW_NORMALIZERS = ("sequences", "local_tokens")


class _LossHead:
    """The loss of one micro-batch from the backbone's hidden states, called inside the model's
    forward (``install_loss_head``); keeps what the metrics need.

    Args:
        plan: the mapped ``GRPOConfig``.
        head: the LM head's settings (temperature / logit scale, dtype).
        inputs: TRL's micro-batch (``completion_ids``, ``advantages``, ``old_per_token_logps``, ...).
        active: bool ``[B, T]``, the completion tokens the loss counts.
        normalizers: ``global_seqs`` / ``global_tokens`` (``config.step_normalizers``).
        entropy_coef: the entropy bonus coefficient to apply now (TRL's, possibly adaptive).
        accumulation: GA, the divisor of TRL's entropy bonus (1 in evaluation).
        invariant: extra arguments of the LM-head ops: ``{}``, or in true on-policy mode
            ``{"invariant": True, "logits_dtype": ...}`` (the patched model's logits, bit for bit).
        sampler: ``[N]`` float32, the sampler's log-probs of the active tokens to compare this pass's
            log-probs with (``mismatch``), or None.
    """

    def __init__(
        self, plan, head, inputs, active, normalizers, entropy_coef, accumulation, invariant=None,
        sampler=None,
    ) -> None:  # fmt: skip
        self.plan, self.settings, self.inputs, self.active = plan, head, inputs, active
        self.normalizers, self.entropy_coef, self.accumulation = normalizers, entropy_coef, accumulation
        self.invariant, self.sampler = invariant or {}, sampler
        self.output = self.entropy = self.kept = self.mismatch = None

    def _advantages(self) -> torch.Tensor:
        adv, active = self.inputs["advantages"], self.active
        if adv.dim() == 2:  # subclasses may give one advantage per token
            if self.plan.config.loss_type == "gspo":
                raise ValueError(
                    "per-token advantages [B, T] with importance_sampling_level='sequence': TRL applies "
                    "the sequence ratio to each token's advantage, rlkernel's gspo to the sequence's mean "
                    "advantage"
                )
            return adv[active]
        return adv[:, None]  # one per sequence of the packed input: [S, 1], whatever N and S are

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        inputs, active, plan = self.inputs, self.active, self.plan
        ids = inputs["completion_ids"]
        width = ids.shape[1]
        # Position t − 1 predicts completion token t: the hidden states of the last T + 1 positions
        # but the final one, packed to the active tokens.
        h, weight, bias = head_inputs(
            hidden[:, -width - 1 : -1][active.to(hidden.device)], weight, bias, self.settings
        )
        ids = ids[active]
        tokens = ids.shape[0]
        cu_seqlens = F.pad(active.sum(-1).cumsum(0), (1, 0))
        old = inputs.get("old_per_token_logps")
        old = None if old is None else old[active]
        cfg = plan.config
        rollout = None
        # TRL's OPSM reads vLLM's log-probs when it has them (else the old ones: rlkernel's fallback),
        # and counts a token vLLM could not score (NaN) as no drift: ŝ = sg[logp] there, which needs
        # the log-probs first (the composed route), unless the vLLM correction is on (see below).
        opsm_vllm = cfg.off_policy_mask_threshold is not None and "sampling_per_token_logps" in inputs
        reads_vllm = opsm_vllm or plan.rollout_correction
        sampling = inputs["sampling_per_token_logps"][active] if reads_vllm else None
        if plan.rollout_correction:
            # TRL gives a token that vLLM could not score the importance ratio 1: ρ = exp(0), ŝ = old
            # (the old log-probs are always there with the correction). OPSM reads the same ŝ: such a
            # token drifts by old − logp there, 0 in TRL (docs: caveats).
            rollout = torch.where(torch.isnan(sampling), old, sampling)
        ref = inputs["ref_per_token_logps"][active] if cfg.kl_coef > 0 else None
        common = dict(
            advantages=self._advantages(),
            mask=torch.ones(tokens, dtype=torch.bool, device=ids.device),
            ref_logp=ref,
            cu_seqlens=cu_seqlens,
            **self.normalizers,
        )
        opsm_nan = opsm_vllm and not plan.rollout_correction
        temperature = self.settings.temperature
        if not plan.entropy_bonus and not opsm_nan:
            # One pass: old_logp=None is TRL's on-policy ratio exp(logp − sg[logp]).
            self.output = fused_policy_loss(
                cfg, token_ids=ids, old_logp=old, hidden=h, weight=weight, bias=bias, rollout_logp=rollout,
                temperature=temperature, **common, **self.invariant,
            )  # fmt: skip
            if self.sampler is not None:
                # The fused loss keeps its log-probs inside; the same op without the loss gives them
                # (with invariant=True bit for bit the loss's: both are the patched head's logits).
                with torch.no_grad():
                    logp = linear_token_logprobs(
                        h.detach(), weight.detach(), ids, bias=None if bias is None else bias.detach(),
                        temperature=temperature, **self.invariant,
                    )  # fmt: skip
                self.mismatch = mismatch_totals(logp, self.sampler)
            return self.output.loss
        # The composed route: TRL's entropy bonus is the token mean of H (over the top-entropy tokens
        # when top_entropy_quantile < 1) divided by GA, whatever the normalizer: no PolicyLossConfig
        # field, so the entropy comes back from the linear primitive and the bonus is added here.
        logp, entropy = linear_token_logprobs(
            h, weight, ids, bias=bias, temperature=temperature, return_entropy=True, **self.invariant
        )
        if self.sampler is not None:
            self.mismatch = mismatch_totals(logp.detach(), self.sampler)
        if opsm_nan:
            rollout = torch.where(torch.isnan(sampling), logp.detach(), sampling)
        self.output = policy_loss(logp, old, cfg=cfg, entropy=entropy, rollout_logp=rollout, **common)
        self.entropy = entropy.detach()
        if not plan.entropy_bonus:
            return self.output.loss
        kept = torch.ones_like(self.entropy, dtype=torch.bool)
        if cfg.top_entropy_quantile < 1 and tokens > 0:
            threshold = torch.quantile(self.entropy.float(), 1.0 - cfg.top_entropy_quantile)
            kept = self.entropy >= threshold
        self.kept = kept
        bonus = (entropy * kept).sum() / kept.sum().clamp(min=1) / self.accumulation
        return self.output.loss - self.entropy_coef * bonus


class RLKernelGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` (TRL 1.16) whose loss is computed by rlkernel from the last hidden states
    and the LM-head weight (module docstring); same constructor and behaviour otherwise, plus one
    keyword.

    Args:
        true_on_policy: False (default): TRL's steps, rlkernel's loss. True: the policy is patched
            with ``rlkernel.invariant.patch_hf_model`` (in place), the loss runs
            ``fused_policy_loss(hidden=..., invariant=True)``, the training forward gets the
            positions ``generate()`` gave the tokens, and the sampler's log-probs (kept while
            ``model.generate`` samples) are the old log-probs: no scoring forward over prompt +
            completion (:mod:`rlkernel.integrations.trl.on_policy`; docs/integrations/trl.md).
        *args, **kwargs: ``trl.GRPOTrainer``'s.

    In both modes, without vLLM, the sampler's log-probs are compared with the loss pass's on every
    micro-batch trained at the weights that sampled it, and logged under TRL's names
    ``sampling/sampling_logp_difference/{mean,max}`` and ``sampling/importance_sampling_ratio/{min,mean,max}``
    (one value per optimizer step; exactly 0 and 1 with ``true_on_policy=True``).

    Attributes:
        rlkernel_plan: the :class:`~rlkernel.integrations.trl.config.TRLLossPlan` of ``args``
            (``rlkernel_plan.config`` is the ``PolicyLossConfig``).
        true_on_policy: the keyword.

    Raises (at construction):
        RuntimeError: the installed TRL is not a 1.16.x release.
        TypeError: ``true_on_policy`` not a bool; with it, a model ``patch_hf_model`` does not support.
        ValueError: a ``GRPOConfig`` setting rlkernel cannot reproduce (docs/integrations/trl.md),
            a vision-language processor, a MoE load-balancing loss, a softcapped LM head, ZeRO-3; with
            ``true_on_policy=True`` every setting that would break the equality, named
            (:func:`rlkernel.integrations.trl.on_policy.check_config` / ``check_trainer``).
    """

    def __init__(self, *args, true_on_policy: bool = False, **kwargs) -> None:
        require_supported_trl()
        check.boolean("true_on_policy", true_on_policy)
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if config is not None:
            plan_from_trl(config)  # before TRL builds models, reference model and vLLM
        fp32_logits = bool(getattr(config, "cast_lm_head_to_fp32", False))
        if true_on_policy:
            on_policy.check_arguments(bound.arguments)
            if config is not None:
                on_policy.check_config(config)
                bound.arguments["args"] = on_policy.config_for_trl(config)  # TRL must not cast the LM head
        super().__init__(*bound.args[1:], **bound.kwargs)
        if true_on_policy and fp32_logits:
            self.args.cast_lm_head_to_fp32 = True  # the trainer's copy says what the user asked for
        self.true_on_policy = true_on_policy
        self.rlkernel_plan: TRLLossPlan = plan_from_trl(self.args)
        if self._is_vlm:
            raise ValueError(
                "vision-language models (a ProcessorMixin processing_class) are not supported yet by "
                "RLKernelGRPOTrainer; use trl.GRPOTrainer (optionally with use_rlkernel_lm_head)"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                "a Mixture-of-Experts load-balancing loss (router_aux_loss_coef != 0) is not supported by "
                "RLKernelGRPOTrainer; set router_aux_loss_coef=0.0"
            )
        model = policy_model(self.model)
        # The LM-head ops' extra arguments: the patched head's logits, bit for bit, in true on-policy.
        self._rlkernel_invariant: dict = {}
        if true_on_policy:
            on_policy.check_trainer(self, model)
            on_policy.patch_policy(model, fp32_logits)
            logits_dtype = torch.float32 if fp32_logits else None
            self._rlkernel_invariant = dict(invariant=True, logits_dtype=logits_dtype)
            if fp32_logits and self.ref_model is not None:
                # TRL did not cast the reference model's head either: its log-probs from float32 logits
                # of the same (frozen) weight values, through rlkernel's copy of TRL's fused head.
                add_rlkernel_lm_head(self.ref_model, temperature=self.temperature, cast_lm_head_to_fp32=True)
        # In true on-policy mode the hidden states stay in the model's dtype (the invariant op makes
        # float32 logits itself); otherwise cast_lm_head_to_fp32 casts them, as TRL's head does.
        self._rlkernel_head: HeadSettings = head_settings(
            model, self.temperature, self.args.cast_lm_head_to_fp32 and not true_on_policy
        )
        install_loss_head(model, self._rlkernel_head)
        # The sampler's log-probs are kept where TRL samples with one model.generate call per batch.
        self._rlkernel_keeps_sampler = not (
            self.use_vllm or self.use_transformers_continuous_batching or self.tools or self.rollout_func
        )
        self._rlkernel_sampler: torch.Tensor | None = None  # [B, N] of the current generation
        self._rlkernel_sampled_at: tuple[int, bool] | None = None  # (global step, training) it sampled at
        self._rlkernel_old_from_sampler = False  # the next old-log-prob scoring pass is answered by it
        self._rlkernel_window: torch.Tensor | None = None  # mismatch totals of the optimizer step

    # -- the sampler's log-probs --------------------------------------------------------------------

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """TRL's, with the sampler's log-probs kept (:class:`SamplerLogprobs`) on its ``model.generate``."""
        if not self._rlkernel_keeps_sampler:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        with SamplerLogprobs(policy_model(self.model), self.temperature) as sampler:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        self._rlkernel_sampler = sampler.logprobs(completion_ids)
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        """TRL's, plus ``sampler_per_token_logps`` ``[B, T]`` in the batch; in true on-policy mode the
        old log-probs TRL would score (when ``gradient_accumulation_steps`` is not a multiple of
        ``steps_per_generation × num_iterations``) are the sampler's instead."""
        self._rlkernel_sampler = None
        generate_every = self.args.steps_per_generation * self.num_iterations
        # TRL 1.16's rule for scoring old log-probs without vLLM (its _generate_and_score_completions).
        wants_old = self.args.gradient_accumulation_steps % generate_every != 0
        self._rlkernel_old_from_sampler = self.true_on_policy and wants_old
        try:
            output = super()._generate_and_score_completions(inputs)
            if self._rlkernel_old_from_sampler:
                raise RuntimeError(
                    "true_on_policy: TRL did not ask for old log-probs where TRL 1.16 does (gradient_"
                    "accumulation_steps is not a multiple of steps_per_generation × num_iterations)"
                )
        finally:
            self._rlkernel_old_from_sampler = False
        sampler, self._rlkernel_sampler = self._rlkernel_sampler, None
        if sampler is not None:
            width = output["completion_ids"].shape[1]  # TRL's padding (pad_to_multiple_of)
            output["sampler_per_token_logps"] = F.pad(sampler.to(output["completion_ids"].device),
                                                      (0, width - sampler.shape[1]))  # fmt: skip
            self._rlkernel_sampled_at = (self.state.global_step, self.model.training)
        return output

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ):
        """TRL's scoring pass; in true on-policy mode, its first call of a generation (the old
        log-probs, which TRL scores before the reference ones) returns the sampler's log-probs
        instead, without a forward."""
        if not self._rlkernel_old_from_sampler:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        self._rlkernel_old_from_sampler = False
        sampler = self._rlkernel_sampler
        if model is not self.model or sampler is None or kwargs.get("compute_entropy"):
            raise RuntimeError(
                "true_on_policy: TRL's first scoring pass of a generation is not the policy's old "
                "log-probs (TRL's order changed?); refusing to answer it with the sampler's log-probs"
            )
        if sampler.shape[0] != input_ids.shape[0] or sampler.shape[1] > logits_to_keep:
            raise RuntimeError(
                f"true_on_policy: the sampler's log-probs {tuple(sampler.shape)} do not fit TRL's batch "
                f"({input_ids.shape[0]} rows, {logits_to_keep} completion positions)"
            )
        old = F.pad(sampler.to(input_ids.device), (0, logits_to_keep - sampler.shape[1]))
        return old, None, None

    def _compute_loss(self, model, inputs):
        plan = self.rlkernel_plan
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        active = mask.bool()
        training = self.model.training
        accumulation = self.current_gradient_accumulation_steps if training else 1
        normalizers = step_normalizers(
            plan,
            batch_size=active.shape[0],
            local_tokens=mask.sum(),
            num_items_in_batch=inputs["num_items_in_batch"],
            accumulation_steps=self.current_gradient_accumulation_steps if training else 1,
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
            training=training,
        )
        coef = self._entropy_coef_now() if plan.entropy_bonus else 0.0
        # The sampler's log-probs are compared with this pass's only at the weights that sampled them.
        sampler = inputs.get("sampler_per_token_logps")
        if sampler is not None and self._rlkernel_sampled_at != (self.state.global_step, training):
            sampler = None
        head = _LossHead(
            plan, self._rlkernel_head, inputs, active, normalizers, coef, accumulation,
            invariant=self._rlkernel_invariant, sampler=None if sampler is None else sampler[active],
        )  # fmt: skip
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        # True on-policy: the positions generate() gave the tokens (TRL passes none: a left-padded
        # row's tokens would sit shifted by its padding, and RoPE round differently).
        extra = {}
        if self.true_on_policy:
            extra["position_ids"] = on_policy.generation_positions(attention_mask)
        with self.accelerator.autocast():
            loss = model(input_ids=input_ids, attention_mask=attention_mask, rlkernel_head=head, **extra).loss
        mode = "train" if training else "eval"
        self._log_rlkernel(head, active, mode, accumulation)
        self._log_sampling(head.mismatch, mode)
        return loss

    def _log_sampling(self, totals: torch.Tensor | None, mode: str) -> None:
        """TRL's ``sampling/*`` metrics from the mismatch totals (``sampler.mismatch_totals``) of the
        micro-batches of one optimizer step (training) or of this batch (evaluation), over all
        processes: one value per step, whatever the accumulation."""
        if mode == "train":
            if totals is not None:
                window = self._rlkernel_window
                both = None if window is None else torch.stack([window, totals])
                self._rlkernel_window = totals if both is None else combine_totals(both)
            if not self.accelerator.sync_gradients or self._rlkernel_window is None:
                return
            totals, self._rlkernel_window = self._rlkernel_window, None
        elif totals is None:
            return
        # Every process measures the same micro-steps (the same step structure): one gather each.
        combined = combine_totals(self.accelerator.gather(totals[None]))
        for name, value in metrics_from_totals(combined).items():
            self._metrics[mode][name].append(value)

    def _entropy_coef_now(self) -> float:
        """TRL's rule: the adaptive controller applies its coefficient only while the entropy measured
        at the end of the previous optimizer step is at or below the target."""
        if self.use_adaptive_entropy:
            return self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        return self.entropy_coef

    def _global_mean(self, total: torch.Tensor, count: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([total.float(), count.float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_rlkernel(self, head: _LossHead, active: torch.Tensor, mode: str, accumulation: int) -> None:
        """TRL's metrics from rlkernel's, and TRL's adaptive-entropy update."""
        plan, metrics, log = self.rlkernel_plan, head.output.metrics, self._metrics[mode]
        tokens = active.sum().float()
        if plan.entropy_bonus:
            scale = accumulation if plan.normalizer in _PER_WINDOW_NORMALIZERS else 1
            log["policy_loss"].append(
                self.accelerator.gather(head.output.loss.detach() * scale).nanmean().item()
            )
            # The controller measures the entropy over the tokens the bonus acts on (TRL's effective mask).
            kept = head.kept.to(head.entropy.dtype)
            self._update_adaptive_entropy((head.entropy * kept).sum(), kept.sum(), mode)
        if plan.config.kl_coef > 0:
            log["kl"].append(self._global_mean(metrics["kl_ref"] * tokens, tokens))
        if head.entropy is not None:
            log["entropy"].append(self._global_mean(head.entropy.sum(), tokens))
        loss_type = plan.config.loss_type
        if loss_type in ("ppo", "gspo"):
            # gspo's fractions are over the sequences with tokens; TRL's over all B rows (an empty row
            # is never clipped), hence the counts below.
            count = active.any(-1).sum().float() if loss_type == "gspo" else tokens
            # On the metrics' device: _global_mean stacks it with them (a CPU tensor fails on CUDA).
            divisor = tokens.new_tensor(float(active.shape[0])) if loss_type == "gspo" else tokens
            low, high = metrics["clip_frac_low"] * count, metrics["clip_frac_high"] * count
            log["clip_ratio/low_mean"].append(self._global_mean(low, divisor))
            log["clip_ratio/high_mean"].append(self._global_mean(high, divisor))
            log["clip_ratio/region_mean"].append(self._global_mean(low + high, divisor))
        elif loss_type == "cispo":
            log["cispo_clip_ratio"].append(self._global_mean(metrics["clip_frac_high"] * tokens, tokens))

    def _update_adaptive_entropy(self, entropy_sum: torch.Tensor, tokens: torch.Tensor, mode: str) -> None:
        """TRL's adaptive entropy controller (Skywork-OR1): accumulate the window's entropy sum and
        token count; at the optimizer-step boundary move the coefficient by ``entropy_coef_delta``
        towards raising the entropy while it is at or below ``entropy_target``, within
        [``entropy_coef_min``, ``entropy_coef_max``]."""
        args = self.args
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([entropy_sum.float(), tokens.float().to(entropy_sum.device)])
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (totals[0] / totals[1].clamp(min=1.0)).item()
                if world <= args.entropy_target:
                    self.entropy_coef = min(
                        self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max
                    )
                else:
                    self.entropy_coef = max(
                        self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min
                    )
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)


# The constructor forwards everything else to GRPOTrainer's: show its signature (help(), IDEs).
_signature = inspect.signature(GRPOTrainer.__init__)
RLKernelGRPOTrainer.__init__.__signature__ = _signature.replace(
    parameters=[
        *_signature.parameters.values(),
        inspect.Parameter("true_on_policy", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool),
    ]
)
