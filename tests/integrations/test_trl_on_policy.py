"""``RLKernelGRPOTrainer(..., true_on_policy=True)``: the sampler's log-probs are the trainer's, bit for bit.

A tiny bf16 Qwen3 trained a few GRPO steps on the CPU (reference backend, bf16 autocast as TRL's
``bf16=True`` gives it): on every optimizer step trained at the weights that sampled its completions,
TRL's ``sampling/*`` metrics are exactly 0 (log-prob difference) and 1 (importance ratios); the old
log-probs of the off-policy micro-batches are the sampler's, and the policy never runs TRL's scoring
forward (counted with a forward pre-hook on the policy: ``fused_lm_head=True`` is TRL's scoring call,
``rlkernel_head`` the loss, anything else ``generate()``). The stock trainer, same start, measures a
mismatch and scores; the kept log-probs' semantics with sampling processors; the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch

from .trl_helpers import (
    dataset,
    grpo_args,
    length_reward,
    load_model,
    require_trl,
    save_tiny_model,
    tokenizer,
)

STEPS = 4
METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
RUNS = {
    # A generation every 4 micro-batches, 2 per optimizer step: TRL would score old log-probs for the
    # second step of each generation; they are the sampler's here.
    "dapo, accumulation 2, steps_per_generation 4": dict(
        gradient_accumulation_steps=2, steps_per_generation=4
    ),
    # float32 logits (TRL's cast_lm_head_to_fp32), a KL to the reference model (its forward stays),
    # TRL's entropy bonus (the composed route), 2 iterations per generation (old log-probs again).
    "fp32 logits, beta, entropy bonus, 2 iterations": dict(
        cast_lm_head_to_fp32=True, beta=0.04, entropy_coef=0.01, num_iterations=2, loss_type="grpo"
    ),
    # Sampling processors change what is drawn, not the kept log-probs; gradient checkpointing; the
    # off-policy sequence mask and the top-entropy quantile (fused_policy_loss's other route).
    "top-k/top-p/min-p/repetition penalty, gradient checkpointing, OPSM, entropy quantile": dict(
        top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.1, temperature=0.8,
        gradient_checkpointing=True, off_policy_mask_threshold=0.5, top_entropy_quantile=0.5,
        gradient_accumulation_steps=2, steps_per_generation=4,
    ),  # fmt: skip
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_trl()
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3_on_policy")))


def bf16_model(model_dir):
    return load_model(model_dir).to(torch.bfloat16)


def build(model_dir, output_dir, *, true_on_policy=True, model=None, **overrides):
    from transformers import PrinterCallback

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    overrides = {"max_steps": STEPS, "bf16": True, **overrides}
    trainer = RLKernelGRPOTrainer(
        model=bf16_model(model_dir) if model is None else model, reward_funcs=length_reward,
        args=grpo_args(str(output_dir), **overrides), train_dataset=dataset(), processing_class=tokenizer(),
        true_on_policy=true_on_policy,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    return trainer


class ForwardCounter:
    """Counts the calls of a model's forward by kind, through a forward pre-hook (torch's documented
    ``register_forward_pre_hook(..., with_kwargs=True)``): TRL's scoring pass calls it with
    ``fused_lm_head=True``, RLKernelGRPOTrainer's loss with ``rlkernel_head``, ``generate()`` with neither."""

    def __init__(self, model) -> None:
        self.counts = {"scoring": 0, "loss": 0, "generate": 0}
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        kind = (
            "scoring"
            if kwargs.get("fused_lm_head")
            else "loss"
            if kwargs.get("rlkernel_head")
            else "generate"
        )
        self.counts[kind] += 1


def train(trainer):
    policy, ref = ForwardCounter(trainer.model), None
    if trainer.ref_model is not None:
        ref = ForwardCounter(trainer.ref_model)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, policy.counts, None if ref is None else ref.counts


@pytest.mark.parametrize("run", list(RUNS))
def test_true_on_policy_mismatch_is_exactly_zero_without_a_scoring_pass(model_dir, tmp_path, run):
    overrides = RUNS[run]
    trainer = build(model_dir, tmp_path, **overrides)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    logs, policy, ref = train(trainer)
    assert len(logs) == STEPS
    # Measured on the optimizer steps trained at the sampler's weights: the first of each generation.
    generate_every = overrides.get("steps_per_generation", 1) * overrides.get("num_iterations", 1)
    ga = overrides.get("gradient_accumulation_steps", 1)
    measured = [i + 1 for i, entry in enumerate(logs) if METRICS[0] in entry]
    assert measured == list(range(1, STEPS + 1, generate_every // ga))
    for entry in logs:
        if METRICS[0] in entry:
            values = [entry[name] for name in METRICS]
            assert values == [0.0, 0.0, 1.0, 1.0, 1.0], (entry["step"], values)
    # No scoring forward of the policy; one loss forward per micro-batch.
    assert policy["scoring"] == 0
    assert policy["loss"] == STEPS * ga and policy["generate"] > 0
    if overrides.get("beta"):
        assert ref["scoring"] == STEPS * ga // generate_every  # the reference pass stays, once per generation
    # TRL asked for old log-probs (ga % generate_every != 0): it got the sampler's, bit for bit.
    for batch in trainer._buffered_inputs:
        assert torch.equal(batch["old_per_token_logps"], batch["sampler_per_token_logps"])
        assert bool((batch["sampler_per_token_logps"][batch["completion_mask"].bool()] < 0).all())
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in trainer.model.named_parameters())
    assert moved > 0  # training changed the weights between generations
    if run == next(iter(RUNS)):  # evaluation: its own generation and loss pass, measured as well
        metrics = trainer.evaluate(eval_dataset=dataset())
        assert [metrics[f"eval_{name}"] for name in METRICS] == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_stock_trainer_measures_the_mismatch_and_scores(model_dir, tmp_path):
    """The same run without true on-policy: TRL's scoring pass runs and the measured mismatch is real."""
    trainer = build(
        model_dir, tmp_path, true_on_policy=False, **RUNS["dapo, accumulation 2, steps_per_generation 4"]
    )
    logs, policy, _ = train(trainer)
    entries = [entry for entry in logs if METRICS[0] in entry]
    assert len(entries) == STEPS // 2
    for entry in entries:
        assert 0 < entry[METRICS[0]] <= entry[METRICS[1]]
        assert entry[METRICS[2]] <= entry[METRICS[3]] <= entry[METRICS[4]] and entry[METRICS[2]] < 1
    # TRL scores each generation's 16 rows (4 per micro-batch x steps_per_generation 4) in chunks of 4.
    assert policy["scoring"] == (STEPS // 2) * 4
    assert not hasattr(trainer.model, "_rlkernel_invariant_state")  # not patched


def test_fp32_logits_mapping(model_dir, tmp_path):
    """cast_lm_head_to_fp32=True: float32 logits from the bf16 weight on both sides; the user's config
    object is left as given, the trainer's copy keeps the flag."""
    from rlkernel.invariant.patch import patched_lm_head_dtype

    args = grpo_args(str(tmp_path), cast_lm_head_to_fp32=True, bf16=True, max_steps=1)
    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    trainer = RLKernelGRPOTrainer(
        model=bf16_model(model_dir), reward_funcs=length_reward, args=args, train_dataset=dataset(),
        processing_class=tokenizer(), true_on_policy=True,
    )  # fmt: skip
    assert patched_lm_head_dtype(trainer.model) == torch.float32
    assert trainer.model.lm_head.weight.dtype == torch.bfloat16  # TRL's cast did not run
    assert args.cast_lm_head_to_fp32 and trainer.args.cast_lm_head_to_fp32 and trainer.args is not args
    assert trainer._rlkernel_invariant == {"invariant": True, "logits_dtype": torch.float32}


def _tiny_patched_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlkernel.invariant import patch_hf_model

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=None,
    )  # fmt: skip
    return patch_hf_model(Qwen3ForCausalLM(config).to(torch.bfloat16))


def test_kept_logprobs_are_the_full_distribution_and_the_trainers_bits():
    """With top-k and a repetition penalty, the kept log-prob of each token is log_softmax(z / τ) of
    the raw logits (float64 reference on generate's own copies), not the processed distribution's;
    and TRL's training layout (left-padded prompt + completion) reproduces it bit for bit through the
    invariant linear path only with the positions generate() used."""
    import rlkernel as rk
    from rlkernel.integrations.trl.on_policy import generation_positions
    from rlkernel.integrations.trl.sampler import SamplerLogprobs

    model, tau = _tiny_patched_model(), 0.7
    lens = [3, 6, 2, 5]
    width = max(lens)
    prompt_mask = torch.tensor([[0] * (width - n) + [1] * n for n in lens])
    prompt = torch.randint(2, 96, (4, width), generator=torch.Generator().manual_seed(1)) * prompt_mask
    torch.manual_seed(2)
    with SamplerLogprobs(model, tau) as sampler, torch.no_grad():
        out = model.generate(
            input_ids=prompt, attention_mask=prompt_mask, do_sample=True, temperature=tau, top_k=4,
            repetition_penalty=1.5, max_new_tokens=7, pad_token_id=0, eos_token_id=1, output_logits=True,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    completions = out.sequences[:, width:]
    kept = sampler.logprobs(completions)
    assert kept.shape == completions.shape and kept.dtype == torch.float32
    ids = completions[..., None]
    raw = torch.log_softmax(torch.stack(out.logits, 1).double() / tau, -1).gather(-1, ids)[..., 0]
    processed = torch.log_softmax(torch.stack(out.scores, 1).double(), -1).gather(-1, ids)[..., 0]
    torch.testing.assert_close(kept.double(), raw, atol=1e-5, rtol=0)
    assert (processed - raw).abs().max() > 0.1  # top-k renormalizes: the drawn distribution differs
    # The trainer's side: [left-padded prompt | completion], one prefill, the invariant linear path.
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completions)], 1)
    tokens = torch.cat([prompt, completions], 1)
    head = model.lm_head.weight
    with torch.no_grad():
        for positions, equal in ((generation_positions(attention_mask), True), (None, False)):
            hidden = model.model(
                input_ids=tokens, attention_mask=attention_mask, position_ids=positions, use_cache=False
            ).last_hidden_state[:, width - 1 : -1]
            logp = rk.linear_token_logprobs(hidden, head, completions, temperature=tau, invariant=True)
            # Without positions (TRL's training forward) a left-padded row's RoPE rounds differently.
            assert torch.equal(logp, kept) is equal


def test_generation_positions():
    from rlkernel.integrations.trl.on_policy import generation_positions

    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]])
    assert torch.equal(generation_positions(mask), expected)


def test_sampler_logprobs_bad_input_and_misalignment():
    from rlkernel.integrations.trl.sampler import SamplerLogprobs

    model = _tiny_patched_model()
    with pytest.raises(ValueError, match="temperature"):
        SamplerLogprobs(model, 0.0)
    with pytest.raises(TypeError, match="model"):
        SamplerLogprobs(object(), 1.0)
    sampler = SamplerLogprobs(model, 1.0)
    with pytest.raises(RuntimeError, match="recorded no forward"):
        sampler.logprobs([[3]])
    prompt = torch.randint(2, 96, (2, 4), generator=torch.Generator().manual_seed(0))
    with sampler, torch.no_grad():
        out = model.generate(
            input_ids=prompt, do_sample=False, max_new_tokens=3, pad_token_id=0, eos_token_id=1
        )
    completions = out[:, 4:].tolist()
    assert sampler.logprobs(completions, width=5).shape == (2, 5)
    with pytest.raises(ValueError, match="width"):
        sampler.logprobs(completions, width=2)
    wrong = [list(c) for c in completions]
    wrong[1][0] = (wrong[1][0] + 1) % 96
    with pytest.raises(RuntimeError, match="differ from the completions"):
        sampler.logprobs(wrong)
    with pytest.raises(RuntimeError, match="generate batch"):
        sampler.logprobs(completions[:1])
    with pytest.raises(RuntimeError, match="generate ran"):
        sampler.logprobs([c + [2, 2] for c in completions])


def test_sampling_metrics_formula():
    from rlkernel.integrations.trl.sampler import sampling_metrics

    g = torch.Generator().manual_seed(3)
    train, sampler = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    got = sampling_metrics(train, sampler, mask)
    d = (train.double() - sampler.double())[mask]
    r = d.exp()
    want = [d.abs().mean(), d.abs().max(), r.min(), r.mean(), r.max()]
    assert list(got) == list(METRICS)
    assert list(got.values()) == pytest.approx([v.item() for v in want], rel=1e-5)
    assert sampling_metrics(train, train) == dict(zip(METRICS, [0.0, 0.0, 1.0, 1.0, 1.0], strict=True))
    assert sampling_metrics(train, sampler, torch.zeros_like(mask)) == {}
    with pytest.raises(ValueError, match="same shape"):
        sampling_metrics(train, sampler[:2])
    with pytest.raises(ValueError, match="mask"):
        sampling_metrics(train, sampler, mask[:2])
    assert math.isfinite(got[METRICS[0]])


# -- refusals ---------------------------------------------------------------------------------------

# GRPOConfig fields and constructor arguments refused before TRL builds anything.
REFUSED_EARLY = [
    (dict(use_vllm=True), "use_vllm"),
    (dict(use_transformers_continuous_batching=True), "use_transformers_continuous_batching"),
    (dict(use_liger_kernel=True), "use_liger_kernel"),
    (dict(torch_compile=True), "torch_compile"),
    (dict(cache_implementation="static"), "cache_implementation"),
    (dict(model_init_kwargs={"use_kernels": True}), "model_init_kwargs"),
    (dict(fsdp="full_shard"), "fsdp"),
]
REFUSED_ARGUMENTS = [
    (dict(peft_config=object()), "peft_config"),
    (dict(tools=[len]), "tools"),
    (dict(rollout_func=lambda prompts, trainer: {}), "rollout_func"),
    (dict(environment_factory=object), "environment_factory"),
]


@pytest.mark.parametrize(("overrides", "name"), REFUSED_EARLY, ids=[name for _, name in REFUSED_EARLY])
def test_refused_config_fields(model_dir, tmp_path, overrides, name):
    with pytest.raises(ValueError, match=f"true_on_policy=True does not support {name}"):
        build(model_dir, tmp_path, **overrides)


@pytest.mark.parametrize(("argument", "name"), REFUSED_ARGUMENTS, ids=[name for _, name in REFUSED_ARGUMENTS])
def test_refused_constructor_arguments(model_dir, tmp_path, argument, name):
    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    with pytest.raises(ValueError, match=f"true_on_policy=True does not support {name}"):
        RLKernelGRPOTrainer(
            model=bf16_model(model_dir), reward_funcs=length_reward, args=grpo_args(str(tmp_path)),
            train_dataset=dataset(), processing_class=tokenizer(), true_on_policy=True, **argument,
        )  # fmt: skip


def test_refused_after_construction(model_dir, tmp_path):
    """What only the built trainer shows: dtypes against the autocast, dropout, the generation mode,
    a model patch_hf_model refuses; and a non-bool keyword."""
    from transformers import MistralConfig, MistralForCausalLM

    with pytest.raises(ValueError, match="mixed precision 'bf16' with parameters in torch.float32"):
        build(model_dir, tmp_path, model=load_model(model_dir))  # float32 weights, bf16=True
    build(model_dir, tmp_path, model=load_model(model_dir), bf16=False)  # float32 both sides: fine
    model = bf16_model(model_dir)
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="config.attention_dropout=0.1"):
        build(model_dir, tmp_path, model=model)
    model = bf16_model(model_dir)
    model.model.layers[0].mlp.add_module("dropout", torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"dropout \(p > 0 in model.layers.0.mlp.dropout\)"):
        build(model_dir, tmp_path, model=model)
    with pytest.raises(ValueError, match="generation mode 'beam_sample'"):
        build(model_dir, tmp_path, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="use_cache=False"):
        build(model_dir, tmp_path, generation_kwargs={"use_cache": False})
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        build(model_dir, tmp_path, generation_kwargs={"prefill_chunk_size": 4})
    mistral = MistralForCausalLM(
        MistralConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )  # fmt: skip
    ).to(torch.bfloat16)
    with pytest.raises(TypeError, match="true_on_policy=True patches the policy with patch_hf_model"):
        build(model_dir, tmp_path, model=mistral)
    with pytest.raises(TypeError, match="true_on_policy"):
        build(model_dir, tmp_path, true_on_policy=1)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors run the Triton kernels only in the interpreter"
)
def test_trl_layout_on_the_triton_path_in_the_interpreter():
    """The GPU code path (Triton kernels, interpreted) on a one-layer bf16 micro model, as the trainer
    runs it: SamplerLogprobs over generate() of left-padded prompts; TRL's training layout (the
    left-padded prompts + the right-padded completions, one prefill) with the generation positions;
    the loss through fused_policy_loss(invariant=True) with the sampler's log-probs as old_logp: its
    log-probs are the sampler's bit for bit (ratio exactly 1). bf16 logits, as the GPU run has them
    (float32 logits: the same chain, tests/invariant/test_invariant_lm_head.py)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import rlkernel as rk
    from rlkernel.integrations.trl.on_policy import generation_positions
    from rlkernel.integrations.trl.sampler import SamplerLogprobs
    from rlkernel.invariant import patch_hf_model

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0, eos_token_id=1,
              tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(Qwen3Config(**kw)).to(torch.bfloat16)
    patch_hf_model(model)
    lens, width, gen, tau = [2, 4, 3], 4, 3, 0.9
    prompt_mask = torch.tensor([[0] * (width - n) + [1] * n for n in lens])
    prompt = torch.randint(2, 64, (3, width), generator=torch.Generator().manual_seed(2)) * prompt_mask
    # The "single" GEMM table, as tests/invariant does: the tuned decode tiles take ~10x longer to interpret.
    options = rk.use_options(linear_chunk_bytes=1, linear_grad_bytes=1, matmul_table="single")
    with rk.use_backend("triton"), options:
        torch.manual_seed(3)
        with SamplerLogprobs(model, tau) as sampler, torch.no_grad():
            out = model.generate(
                input_ids=prompt, attention_mask=prompt_mask, do_sample=True, temperature=tau,
                max_new_tokens=gen, pad_token_id=0, eos_token_id=1,
            )  # fmt: skip
        completions = out[:, width:]
        kept = sampler.logprobs(completions)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(completions)], 1)
        hidden = model.model(
            input_ids=torch.cat([prompt, completions], 1), attention_mask=attention_mask,
            position_ids=generation_positions(attention_mask), use_cache=False,
        ).last_hidden_state[:, width - 1 : -1]  # fmt: skip
        cfg = rk.PolicyLossConfig.preset("dapo")
        mask = torch.ones_like(completions, dtype=torch.bool)
        loss = rk.fused_policy_loss(
            cfg, token_ids=completions, old_logp=kept, advantages=torch.tensor([1.0, -0.5, 0.25]),
            mask=mask, hidden=hidden, weight=model.lm_head.weight, temperature=tau, invariant=True,
        )  # fmt: skip
        with torch.no_grad():
            head = model.lm_head.weight
            logp = rk.linear_token_logprobs(hidden, head, completions, temperature=tau, invariant=True)
    assert torch.equal(logp, kept)
    assert loss.metrics["ratio_min"].item() == loss.metrics["ratio_max"].item() == 1.0


QWEN3_VOCAB = 151936


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp32_logits", [False, True])
def test_true_on_policy_on_the_gpu(tmp_path_factory, tmp_path, fp32_logits):
    """On a CUDA device (the Triton kernels), the tiny model with Qwen3's 151,936-row LM head in bf16
    under bf16 autocast: 4 steps, a generation every 2; the mismatch exactly 0 on the measured steps,
    no scoring forward; the stock trainer on the same start measures a mismatch > 0."""
    require_trl()
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3_vocab")), vocab=QWEN3_VOCAB)
    runs, overrides = {}, RUNS["dapo, accumulation 2, steps_per_generation 4"]
    for true_on_policy in (True, False):
        model = load_model(model_dir).to(device="cuda", dtype=torch.bfloat16)
        trainer = build(
            model_dir, tmp_path / str(true_on_policy), model=model, true_on_policy=true_on_policy,
            use_cpu=False, cast_lm_head_to_fp32=fp32_logits, **overrides,
        )  # fmt: skip
        runs[true_on_policy] = train(trainer)
    logs, policy, _ = runs[True]
    measured = [[entry[name] for name in METRICS] for entry in logs if METRICS[0] in entry]
    assert measured == [[0.0, 0.0, 1.0, 1.0, 1.0]] * 2 and policy["scoring"] == 0
    logs, policy, _ = runs[False]
    assert all(entry[METRICS[1]] > 0 for entry in logs if METRICS[0] in entry) and policy["scoring"] > 0
