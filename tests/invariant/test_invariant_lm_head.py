"""The patched LM head and the fused hidden-state path: ``patch_hf_model(lm_head_dtype=...)`` and
``linear_token_logprobs(..., invariant=True)`` reproducing a patched model's decode log-probs.

End to end on tiny random Qwen3 models in bf16: the log-probs of KV-cache decode (left-padded
batches, through ``generate()``) are bitwise those of the memory-flat training path (a right-padded
prefill through the base model, then ``linear_token_logprobs(hidden, lm_head.weight, ...,
invariant=True)``), for bf16 and fp32 logits, on the CPU path (reference backend) and on the GPU
code path in the Triton interpreter (a one-layer micro model). Plus the ``lm_head_dtype`` option
itself: what it swaps, exact unpatching, training, bad input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rlkernel as rk
from rlkernel.invariant import patch_hf_model, unpatch_hf_model
from rlkernel.invariant.consistency import build_model, fused_prefill_logprobs
from rlkernel.invariant.patch import is_patched, patched_lm_head_dtype
from rlkernel.invariant.scoring import decode_logprobs, make_prompts, prefill_logprobs, rollout

CPU = torch.device("cpu")
FP32 = torch.float32


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def bf16_model():
    return build_model("tiny", device=CPU, dtype=torch.bfloat16, seed=3)


def _ids(b, t, seed=0):
    return torch.randint(1, 512, (b, t), generator=torch.Generator().manual_seed(seed))


def test_lm_head_dtype_float32_swaps_the_head_only_and_unpatches_exactly(bf16_model):
    m = copy.deepcopy(bf16_model)
    ids = _ids(2, 7)
    with torch.no_grad():
        before = m(input_ids=ids).logits
        patch_hf_model(m)
        z16 = m(input_ids=ids).logits
        assert patched_lm_head_dtype(m) == torch.bfloat16
        unpatch_hf_model(m)
        patch_hf_model(m, lm_head_dtype=FP32)
        patch_hf_model(m, lm_head_dtype=FP32)  # the same request again: a no-op
        z32 = m(input_ids=ids).logits
        assert patched_lm_head_dtype(m) == FP32
        assert type(m.lm_head).__name__ == "InvariantFp32LogitsLinear" and isinstance(m.lm_head, nn.Linear)
        assert type(m.model.layers[0].mlp.up_proj).__name__ == "InvariantLinear"
        unpatch_hf_model(m)
        after = m(input_ids=ids).logits
    assert z16.dtype == torch.bfloat16 and z32.dtype == FP32 and before.dtype == torch.bfloat16
    # one fp32 accumulator: the default head's logits are the fp32 head's, rounded to bf16
    assert torch.equal(z16, z32.to(torch.bfloat16)) and not torch.equal(z16.float(), z32)
    assert torch.equal(after, before) and type(m.lm_head) is nn.Linear and patched_lm_head_dtype(m) is None
    torch.testing.assert_close(z32, before.float(), atol=0.1, rtol=0.02)  # bf16 HF logits: one rounding


def test_lm_head_dtype_of_an_fp32_model_is_the_default():
    m = build_model("tiny", device=CPU, dtype=FP32, seed=0)
    patch_hf_model(m, lm_head_dtype=FP32)
    assert type(m.lm_head).__name__ == "InvariantLinear" and patched_lm_head_dtype(m) == FP32
    patch_hf_model(m)  # the same patch (fp32 logits either way): no-op
    unpatch_hf_model(m)


def test_lm_head_dtype_bad_input(bf16_model):
    from transformers import Qwen3Model

    m = copy.deepcopy(bf16_model)
    for bad in (torch.float16, torch.float64, "float32"):
        with pytest.raises(ValueError, match="lm_head_dtype must be"):
            patch_hf_model(m, lm_head_dtype=bad)
    assert not is_patched(m)
    with pytest.raises(ValueError, match="needs a model with an lm_head"):
        patch_hf_model(Qwen3Model(m.config), lm_head_dtype=FP32)
    patch_hf_model(m, lm_head_dtype=FP32)
    with pytest.raises(ValueError, match="already patched with lm_head_dtype"):
        patch_hf_model(m)
    unpatch_hf_model(m)
    patch_hf_model(m)
    with pytest.raises(ValueError, match="already patched with lm_head_dtype"):
        patch_hf_model(m, lm_head_dtype=FP32)
    unpatch_hf_model(m)

    class ScaledHead(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    m.lm_head.__class__ = ScaledHead
    with pytest.raises(ValueError, match="needs the lm_head patched"):
        patch_hf_model(m, allow_unpatched=True, lm_head_dtype=FP32)
    assert not is_patched(m)


def test_fp32_head_training_backward_matches_unpatched(bf16_model):
    """Training through the fp32 head: the loss of fp32 logits, gradients close to HF's on the
    same fp32 logits (its gradient is rounded to bf16 before the head's backward GEMMs)."""
    ref, m = copy.deepcopy(bf16_model), patch_hf_model(copy.deepcopy(bf16_model), lm_head_dtype=FP32)
    ids = _ids(2, 9, seed=5)
    grads = []
    for net, cast in ((ref, True), (m, False)):
        logits = net(input_ids=ids).logits
        logits = logits.float() if cast else logits
        assert logits.dtype == FP32
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
        loss.backward()
        grads.append({n: p.grad.float() for n, p in net.named_parameters()})
    for name, g in grads[0].items():
        rel = ((grads[1][name] - g).norm() / g.norm()).item()
        assert rel < 5e-2, (name, rel)


@pytest.mark.parametrize("lm_head_dtype", [None, FP32])
def test_decode_logprobs_equal_the_fused_invariant_prefill(bf16_model, lm_head_dtype):
    """The CPU path end to end: teacher-forced KV-cache decode at batch 1 and 3 (left padding),
    the logits prefill, and the fused hidden-state path all give the same bits."""
    m = copy.deepcopy(bf16_model)
    prompts = make_prompts(4, 6, 512, seed=4)
    completions = rollout(m, prompts, 5, 4, seed=4)
    patch_hf_model(m, **({} if lm_head_dtype is None else {"lm_head_dtype": lm_head_dtype}))
    fused = fused_prefill_logprobs(m, prompts, completions, 4, invariant=True, logits_dtype=lm_head_dtype)
    assert fused.shape == (4, 5) and bool((fused < 0).all())
    for b in (1, 3):
        assert torch.equal(decode_logprobs(m, prompts, completions, b), fused)
    assert torch.equal(prefill_logprobs(m, prompts, completions, 2), fused)
    # A different micro-batch of the trainer changes no bit either
    assert torch.equal(fused_prefill_logprobs(m, prompts, completions, 3, invariant=True,
                                              logits_dtype=lm_head_dtype), fused)  # fmt: skip


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors run the Triton kernels only in the interpreter"
)
@pytest.mark.parametrize("lm_head_dtype", [None, FP32])
def test_triton_decode_equals_fused_prefill_in_the_interpreter(lm_head_dtype):
    """The GPU code path (interpreted), bf16 micro model: the log-probs of three left-padded
    prompts' greedy decode steps equal ``linear_token_logprobs(..., invariant=True)`` on the
    hidden states of one right-padded prefill of the finished sequences."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_implementation="sdpa",
              pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(1)
    m = Qwen3ForCausalLM(Qwen3Config(**kw)).eval().to(torch.bfloat16)
    patch_hf_model(m, **({} if lm_head_dtype is None else {"lm_head_dtype": lm_head_dtype}))
    lens = [2, 3, 4]
    prompts = torch.randint(1, 64, (3, 4), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[0] * (4 - n) + [1] * n for n in lens])
    prompts = prompts * mask  # left padding with the pad id
    gen = 3
    # The "single" GEMM table: the tuned one's decode tiles take ~10x longer to interpret (the
    # tuned table is checked in tests/ops/test_linear_invariant.py and on the GPU).
    options = rk.use_options(linear_chunk_bytes=1, linear_grad_bytes=1, matmul_table="single")
    with rk.use_backend("triton"), options, torch.no_grad():
        out = m.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=gen, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        new = out.sequences[:, 4:]
        decoded = torch.stack(out.logits, dim=1)  # [3, gen, V] fp32 copies of the step logits
        decode_logp = rk.token_logprobs(decoded, new)
        # The trainer: prompt + completion right-padded, targets at the positions before them.
        seqs = [torch.cat([prompts[i, 4 - n :], new[i]]) for i, n in enumerate(lens)]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(3, width, dtype=torch.long)
        am = torch.zeros(3, width, dtype=torch.long)
        target = torch.full((3, width), -100)
        for i, (s, n) in enumerate(zip(seqs, lens, strict=True)):
            ids[i, : len(s)], am[i, : len(s)] = s, 1
            target[i, n - 1 : n - 1 + gen] = new[i]
        hidden = m.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        logp = rk.linear_token_logprobs(
            hidden, m.lm_head.weight, target, invariant=True, logits_dtype=lm_head_dtype
        )
    fused = torch.stack([logp[i, n - 1 : n - 1 + gen] for i, n in enumerate(lens)])
    assert torch.equal(fused, decode_logp)
