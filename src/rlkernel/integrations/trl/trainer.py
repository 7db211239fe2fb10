"""``RLKernelGRPOTrainer``: TRL 1.16's ``GRPOTrainer`` whose loss is rlkernel's, from hidden states.

    from rlkernel.integrations.trl import RLKernelGRPOTrainer   # instead of trl.GRPOTrainer

Same constructor, generation, rewards, advantages, old and reference log-probs (TRL's own code);
only ``_compute_loss`` changes. TRL's computes the per-token log-probs with its fused LM head and
then the loss on ``[B, T]`` tensors; this one runs the backbone, takes the last hidden states of the
completion positions and the LM-head weight, and computes the loss with

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
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from trl import GRPOTrainer

from rlkernel import fused_policy_loss, linear_token_logprobs, policy_loss
from rlkernel.integrations.trl.config import (
    TRLLossPlan,
    plan_from_trl,
    require_supported_trl,
    step_normalizers,
)
from rlkernel.integrations.trl.head import (
    HeadSettings,
    head_inputs,
    head_settings,
    install_loss_head,
    policy_model,
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
    """

    def __init__(self, plan, head, inputs, active, normalizers, entropy_coef, accumulation) -> None:
        self.plan, self.settings, self.inputs, self.active = plan, head, inputs, active
        self.normalizers, self.entropy_coef, self.accumulation = normalizers, entropy_coef, accumulation
        self.output = self.entropy = self.kept = None

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
        if not plan.entropy_bonus and not opsm_nan:
            # One pass: old_logp=None is TRL's on-policy ratio exp(logp − sg[logp]).
            self.output = fused_policy_loss(
                cfg, token_ids=ids, old_logp=old, hidden=h, weight=weight, bias=bias, rollout_logp=rollout,
                temperature=self.settings.temperature, **common,
            )  # fmt: skip
            return self.output.loss
        # The composed route: TRL's entropy bonus is the token mean of H (over the top-entropy tokens
        # when top_entropy_quantile < 1) divided by GA, whatever the normalizer: no PolicyLossConfig
        # field, so the entropy comes back from the linear primitive and the bonus is added here.
        logp, entropy = linear_token_logprobs(
            h, weight, ids, bias=bias, temperature=self.settings.temperature, return_entropy=True
        )
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
    and the LM-head weight (module docstring); same constructor and behaviour otherwise.

    Attributes:
        rlkernel_plan: the :class:`~rlkernel.integrations.trl.config.TRLLossPlan` of ``args``
            (``rlkernel_plan.config`` is the ``PolicyLossConfig``).

    Raises (at construction):
        RuntimeError: the installed TRL is not a 1.16.x release.
        ValueError: a ``GRPOConfig`` setting rlkernel cannot reproduce (docs/integrations/trl.md),
            a vision-language processor, a MoE load-balancing loss, a softcapped LM head, ZeRO-3.
    """

    def __init__(self, *args, **kwargs) -> None:
        require_supported_trl()
        config = kwargs["args"] if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if config is not None:
            plan_from_trl(config)  # before TRL builds models, reference model and vLLM
        super().__init__(*args, **kwargs)
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
        self._rlkernel_head: HeadSettings = head_settings(
            model, self.temperature, self.args.cast_lm_head_to_fp32
        )
        install_loss_head(model, self._rlkernel_head)

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
        head = _LossHead(plan, self._rlkernel_head, inputs, active, normalizers, coef, accumulation)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.accelerator.autocast():
            loss = model(input_ids=input_ids, attention_mask=attention_mask, rlkernel_head=head).loss
        self._log_rlkernel(head, active, "train" if training else "eval", accumulation)
        return loss

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


# The constructor forwards everything to GRPOTrainer's: show its signature (help(), IDEs).
RLKernelGRPOTrainer.__init__.__signature__ = inspect.signature(GRPOTrainer.__init__)
