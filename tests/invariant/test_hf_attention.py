"""The transformers adapter: tiny random Qwen3/Llama models on CPU (reference backend) and the
adapter's own outputs compared bitwise across decode, prefill, padding sides and packing."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlkernel.invariant.hf_attention import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    hf_attention_forward,
    register_hf_attention,
)

HQ, HKV, D = 4, 2, 16
# The adapter test runs where the kernels run: CUDA on a GPU machine, the CPU interpreter otherwise.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_model(kind):
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=D,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


def padded_prompts(lens, total):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (len(lens), total), generator=g)
    mask = torch.zeros(len(lens), total, dtype=torch.long)
    for i, t in enumerate(lens):
        mask[i, total - t :] = 1
    return ids, mask


class FakeModule(torch.nn.Module):
    is_causal = True
    num_key_value_groups = HQ // HKV


def hf_mask(valid, tq, tk):
    """transformers-style [B, 1, Tq, Tk] bool mask: causal (bottom-right) and not padding."""
    keys = torch.arange(tk)
    qpos = tk - tq + torch.arange(tq)
    causal = keys[None, :] <= qpos[:, None]
    return (causal[None] & valid[:, None, :].bool())[:, None]


def seq_states(t, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(HQ, t, D, generator=g),
        torch.randn(HKV, t, D, generator=g),
        torch.randn(HKV, t, D, generator=g),
    )


def stack(parts, total, side):
    out = []
    for i, p in enumerate(parts):
        pad = torch.randn(
            p.shape[0], total - p.shape[1], p.shape[2], generator=torch.Generator().manual_seed(50 + i)
        )
        out.append(torch.cat([pad, p] if side == "left" else [p, pad], dim=1))
    return torch.stack(out)


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", request.param)
    return request.param


def test_register_is_idempotent():
    assert register_hf_attention() == ATTN_IMPLEMENTATION
    assert register_hf_attention() == ATTN_IMPLEMENTATION
    assert transformers.AttentionInterface()[ATTN_IMPLEMENTATION] is hf_attention_forward


def test_adapter_rows_bitwise_equal_across_compositions(backend):
    """Prefill alone, left-padded batch, right-padded batch, packed (block-diagonal mask) and
    token-by-token decode against a left-padded cache all give one sequence the same bits."""
    lens = [9, 14, 5]
    seqs = [[x.to(DEVICE) for x in seq_states(t, seed=i)] for i, t in enumerate(lens)]
    module = FakeModule()
    alone = [hf_attention_forward(module, q[None], k[None], v[None], None)[0][0] for q, k, v in seqs]
    total = max(lens)
    valid_left = torch.stack([torch.arange(total) >= total - t for t in lens])
    valid_right = torch.stack([torch.arange(total) < t for t in lens])
    for side, valid in (("left", valid_left), ("right", valid_right)):
        q, k, v = (stack([s[j].cpu() for s in seqs], total, side).to(DEVICE) for j in range(3))
        mask = hf_mask(valid, total, total).to(DEVICE)
        out = hf_attention_forward(module, q, k, v, mask, scaling=D**-0.5)[0]
        for i, t in enumerate(lens):
            rows = slice(total - t, total) if side == "left" else slice(0, t)
            assert torch.equal(out[i, rows], alone[i])
    # decode: the last two tokens of every sequence, each step at batch 3 with a left-padded cache
    for back in (2, 1):
        width = total - back + 1
        parts = [[x[:, : t - back + 1] for x in s] for s, t in zip(seqs, lens, strict=True)]
        q, k, v = (stack([p[j].cpu() for p in parts], width, "left").to(DEVICE) for j in range(3))
        valid = torch.stack([torch.arange(width) >= width - (t - back + 1) for t in lens])
        out = hf_attention_forward(module, q[:, :, -1:], k, v, hf_mask(valid, 1, width).to(DEVICE))[0]
        for i, t in enumerate(lens):
            assert torch.equal(out[i, 0], alone[i][t - back])
    # packed: one row holding all three sequences, block-diagonal mask as transformers builds it
    q, k, v = (torch.cat([s[j] for s in seqs], dim=1)[None] for j in range(3))
    n = sum(lens)
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    block = (seg[:, None] == seg[None, :]) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
    out = hf_attention_forward(module, q, k, v, block[None, None].to(DEVICE))[0][0]
    starts = [0, lens[0], lens[0] + lens[1]]
    for i, t in enumerate(lens):
        assert torch.equal(out[starts[i] : starts[i] + t], alone[i])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out_kw = hf_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0][0]
    assert torch.equal(out_kw, out)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_model_forward_matches_sdpa_and_generate_works(kind, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "reference")
    name = register_hf_attention()
    model = tiny_model(kind)
    ids, mask = padded_prompts([12, 7, 3], 12)
    logits = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[name][real], logits["sdpa"][real], atol=1e-5, rtol=1e-5)

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape[2])
        return hf_attention_forward(*args, **kwargs)

    transformers.AttentionInterface.register("rlkernel_spy", spy)
    transformers.masking_utils.AttentionMaskInterface.register(
        "rlkernel_spy", transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    )
    model.set_attn_implementation("rlkernel_spy")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (3, 16)
    assert calls[0] == 12 and calls[-1] == 1  # prefill, then one-token decode steps with the cache
    model.set_attn_implementation("sdpa")
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


def test_training_forward_backward(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "reference")
    name = register_hf_attention()
    model = tiny_model("qwen3").train()
    ids, mask = padded_prompts([10, 6], 10)
    grads = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads[impl] = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    torch.testing.assert_close(grads[name], grads["sdpa"], atol=1e-5, rtol=1e-4)


def test_adapter_bad_input():
    q, k, v = (x[None] for x in seq_states(4, 0))
    module = FakeModule()
    with pytest.raises(ValueError, match="dropout"):
        hf_attention_forward(module, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        hf_attention_forward(module, q, k, v, None, sliding_window=2)
    with pytest.raises(ValueError, match="attention_mask"):
        hf_attention_forward(module, q, k, v, torch.ones(1, 4, dtype=torch.bool))
    module.is_causal = False
    with pytest.raises(ValueError, match="causal"):
        hf_attention_forward(module, q, k, v, None)


def test_packed_position_ids(monkeypatch):
    """transformers builds a block-diagonal mask from restarting position_ids (no cache): the adapter
    runs the packed form, so each packed sequence scores as if alone."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "reference")
    model = tiny_model("qwen3")
    model.set_attn_implementation(register_hf_attention())
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 128, (1, 7), generator=g), torch.randint(0, 128, (1, 5), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits[0]
        alone = [model(x, use_cache=False).logits[0] for x in (a, b)]
    torch.testing.assert_close(packed[:7], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[7:], alone[1], atol=1e-5, rtol=1e-5)
