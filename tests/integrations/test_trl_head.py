"""``add_rlkernel_lm_head`` / ``use_rlkernel_lm_head`` against TRL 1.16's fused LM head.

TRL's ``add_fused_lm_head`` and rlkernel's patch two copies of the same model; the same calls give
the same ``FusedCausalLMOutput`` (log-probs, entropy, loss, label mask) and the same gradients, to
1e-6 in float32. On a ``GRPOTrainer`` the current, old and reference log-probs and TRL's own loss are
unchanged by the swap.
"""

from __future__ import annotations

import pytest
import torch

from .trl_helpers import (
    dataset,
    grpo_args,
    length_reward,
    load_model,
    loss_and_grads,
    make_batch,
    max_grad_diff,
    require_trl,
    save_tiny_model,
    tokenizer,
)

TOL = 1e-6
# Log-probs and entropies of ~5 nats sum 300 vocabulary terms in float32: each head is ~1e-6 off the
# float64 values (test_head_is_as_accurate_as_trls), so two heads agree to a few ulps of the value's
# scale, not to 1e-6 absolute.
SCALED = 2e-6
# Gradients (through the entropy at τ = 0.7 they reach ~40) sum over tokens and vocabulary: 5e-6.
SCALED_GRAD = 5e-6


def assert_close(x: torch.Tensor, ref: torch.Tensor, tol: float = SCALED) -> None:
    """max |x − ref| <= tol · max(1, max |ref|)."""
    assert (x - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_trl()
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")))


def patched_pair(model_dir, *, logit_scale=None, **head_args):
    """(TRL-patched, rlkernel-patched) copies of the tiny model."""
    from trl.trainer.utils import add_fused_lm_head

    from rlkernel.integrations.trl import add_rlkernel_lm_head

    models = []
    for patch in (add_fused_lm_head, add_rlkernel_lm_head):
        model = load_model(model_dir)
        if logit_scale is not None:
            model.config.logit_scale = logit_scale
        patch(model, **head_args)
        models.append(model)
    return models


def inputs(seed=0, B=3, S=10):
    """Left-padded sequences; labels -100 on padding and on the first 4 (prompt) positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (B, S), generator=g)
    pad = torch.tensor([0, 3, 1])
    attention_mask = (torch.arange(S)[None] >= pad[:, None]).long()
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[:, :4] = -100
    return ids, attention_mask, labels


def run(model, call):
    model.zero_grad(set_to_none=True)
    out = call(model)
    objective = out.loss + (0.3 * out.entropy.sum() if out.entropy is not None else 0)
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(theirs, ours):
    (ref, ref_grads), (out, grads) = theirs, ours
    assert torch.equal(out.label_mask, ref.label_mask)
    assert_close(out.log_probs, ref.log_probs)
    assert (out.log_probs[~out.label_mask] == 0).all()
    assert_close(out.loss, ref.loss)
    if ref.entropy is not None:
        assert_close(out.entropy, ref.entropy)
        assert (out.entropy[~out.label_mask] == 0).all()
    for name, grad in ref_grads.items():
        assert_close(grads[name], grad, SCALED_GRAD)
    assert max(g.abs().max().item() for g in ref_grads.values()) > 1e-4


@pytest.mark.parametrize(
    "head_args",
    [
        dict(),
        dict(temperature=0.7, outputs=("log_probs", "entropy")),
        dict(temperature=1.3, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy")),
        dict(logit_scale=0.6, temperature=0.9, outputs=("log_probs", "entropy")),
    ],
    ids=["defaults", "temperature, entropy", "fp32 head", "logit scale"],
)
def test_fused_head_matches_trl(model_dir, head_args):
    ids, attention_mask, labels = inputs()
    trl_model, rk_model = patched_pair(model_dir, **head_args)

    def call(model):
        return model(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)

    assert_same(run(trl_model, call), run(rk_model, call))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_is_as_accurate_as_trls(model_dir, temperature):
    """Against float64 log-softmax of the same hidden states, rlkernel's head is within 2e-6 (and
    within twice TRL's own error where that is larger)."""
    ids, attention_mask, labels = inputs(seed=5)
    trl_model, rk_model = patched_pair(model_dir, temperature=temperature, outputs=("log_probs", "entropy"))
    with torch.no_grad():
        theirs, ours = (
            m(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
            for m in (trl_model, rk_model)
        )
        hidden = trl_model.model(input_ids=ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
        log_softmax = torch.log_softmax(
            hidden.double() @ trl_model.lm_head.weight.double().T / temperature, -1
        )
    target = labels[:, 1:]
    mask = target != -100
    exact = {
        "log_probs": log_softmax.gather(-1, target.clamp(min=0)[..., None])[..., 0],
        "entropy": -(log_softmax.exp() * log_softmax).sum(-1),
    }
    for name, value in exact.items():
        error = (getattr(ours, name) - value)[mask].abs().max().item()
        trl_error = (getattr(theirs, name) - value)[mask].abs().max().item()
        assert error <= max(2e-6, 2 * trl_error), (name, error, trl_error)


def test_shift_labels_and_num_items_match_trl(model_dir):
    """Pre-shifted labels (context parallelism) are scored without shifting; ``num_items_in_batch``
    divides the loss."""
    ids, attention_mask, labels = inputs(seed=1)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    trl_model, rk_model = patched_pair(model_dir, outputs=("log_probs", "entropy"))

    def call(model):
        return model(
            input_ids=ids, attention_mask=attention_mask, shift_labels=shift,
            num_items_in_batch=torch.tensor(11.0), fused_lm_head=True,
        )  # fmt: skip

    assert_same(run(trl_model, call), run(rk_model, call))


def test_other_calls_and_generation_are_unchanged(model_dir):
    """Without ``fused_lm_head`` the forward is the model's own (logits), and ``generate`` works."""
    ids, attention_mask, _ = inputs(seed=2)
    plain = load_model(model_dir)
    (_, patched) = patched_pair(model_dir)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids, attention_mask=attention_mask).logits,
                           patched(input_ids=ids, attention_mask=attention_mask).logits)  # fmt: skip
    torch.manual_seed(0)
    expected = plain.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert torch.equal(patched.generate(ids[:1], max_new_tokens=3, do_sample=False), expected)


def test_all_masked_batch_gives_zero_loss_and_zero_gradients(model_dir):
    """No scored label: log-probs 0, loss 0 (as TRL's 0 / max(0, 1)), and the output still backprops."""
    ids, attention_mask, labels = inputs(seed=3)
    (_, model) = patched_pair(model_dir, outputs=("log_probs", "entropy"))
    out = model(
        input_ids=ids, attention_mask=attention_mask, labels=torch.full_like(labels, -100), fused_lm_head=True
    )
    assert out.loss.item() == 0 and (out.log_probs == 0).all() and (out.entropy == 0).all()
    out.loss.backward()
    assert all((p.grad is None or (p.grad == 0).all()) for p in model.parameters())


def test_use_rlkernel_lm_head_keeps_trl_log_probs_and_loss(model_dir, tmp_path):
    """On a GRPOTrainer with a reference model: current, old and reference log-probs and entropies,
    TRL's loss and its gradients are those of TRL's own head."""
    from trl import GRPOTrainer

    from rlkernel.integrations.trl import use_rlkernel_lm_head

    trainer = GRPOTrainer(
        model=load_model(model_dir), reward_funcs=length_reward,
        args=grpo_args(
            str(tmp_path), beta=0.05, use_bias_correction_kl=False, temperature=0.8, loss_type="grpo"
        ),
        train_dataset=dataset(), processing_class=tokenizer(),
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = make_batch(trainer, seed=4)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    mask = batch["completion_mask"].bool()

    def scores():
        with torch.no_grad():
            policy = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention_mask, 7, compute_entropy=True
            )
            ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention_mask, 7)
        return policy[0], policy[1], ref[0]

    before = scores()
    ref_loss, ref_grads = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    use_rlkernel_lm_head(trainer)
    after = scores()
    loss, grads = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    for x, y in zip(before, after, strict=True):
        assert_close(y[mask], x[mask])
    assert (loss - ref_loss).abs().item() <= TOL
    assert max_grad_diff(grads, ref_grads) <= TOL
    with pytest.raises(TypeError, match="GRPOTrainer"):
        use_rlkernel_lm_head(trainer.model)
