"""fused_policy_loss equals policy_loss(token_logprobs(...)) from logits and from hidden states."""

import pytest
import torch

import rlkernel as rk
from rlkernel.ops.routes import Route

from .formulas_more import MORE_LOSS_CONFIGS
from .helpers import LOSS_CONFIGS, config, make_batch

VOCAB, HIDDEN = 13, 8
# Every loss type, plus the issue-14 loss types and options (none of them takes the token-level
# plan except token-sum with an eligible loss type; the fused call must equal the composition).
FUSED_CONFIGS = {
    **LOSS_CONFIGS,
    **MORE_LOSS_CONFIGS,
    "ppo_kl_ratio_weighted": {**LOSS_CONFIGS["ppo"], "kl_ratio_weighted": True},
    "gspo_kl_ratio_weighted": {**LOSS_CONFIGS["gspo"], "kl_ratio_weighted": True},
    "cispo_token_sum": {**LOSS_CONFIGS["cispo"], "aggregation": "token-sum"},
}


def _problem(seed=0, packed=False):
    """Logits/hidden/weight leaves, ids with garbage (-1, out-of-vocab pad ids) at masked positions."""
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(3, 5, seed=seed)
    mask = batch["mask"]
    ids = torch.randint(0, VOCAB, mask.shape, generator=g)
    ids = torch.where(mask, ids, torch.where(torch.rand(mask.shape, generator=g) > 0.5, -1, VOCAB + 7))
    lead = mask.shape
    cu = None
    if packed:
        lengths = [5, 2, 4]
        cu = torch.tensor([0, 5, 7, 11])
        take = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])  # noqa: E731
        ids, batch = take(ids), {k: (take(v.detach()) if v.dim() == 2 else v) for k, v in batch.items()}
        lead = ids.shape
    return dict(
        ids=ids,
        cu=cu,
        batch=batch,
        logits=torch.randn(*lead, VOCAB, generator=g, dtype=torch.float64).requires_grad_(True),
        hidden=torch.randn(*lead, HIDDEN, generator=g, dtype=torch.float64).requires_grad_(True),
        weight=torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64).requires_grad_(True),
        bias=torch.randn(VOCAB, generator=g, dtype=torch.float64).requires_grad_(True),
    )


def _composed(cfg, p, source, temperature):
    ids = torch.where(p["batch"]["mask"] != 0, p["ids"], -100)
    want_entropy = cfg.entropy_coef != 0
    if source == "logits":
        out = rk.token_logprobs(p["logits"], ids, temperature=temperature, return_entropy=want_entropy)
    else:
        out = rk.linear_token_logprobs(
            p["hidden"],
            p["weight"],
            ids,
            bias=p["bias"],
            temperature=temperature,
            return_entropy=want_entropy,
        )
    logp, entropy = out if want_entropy else (out, None)
    b = p["batch"]
    return rk.policy_loss(
        logp,
        b["old_logp"],
        b["advantages"],
        b["mask"],
        cfg,
        ref_logp=b["ref_logp"],
        rollout_logp=b["rollout_logp"],
        entropy=entropy,
        cu_seqlens=p["cu"],
    )


def _fused(cfg, p, source, temperature):
    b = p["batch"]
    inputs = (
        {"logits": p["logits"]}
        if source == "logits"
        else {"hidden": p["hidden"], "weight": p["weight"], "bias": p["bias"]}
    )
    return rk.fused_policy_loss(
        cfg,
        token_ids=p["ids"],
        old_logp=b["old_logp"],
        advantages=b["advantages"],
        mask=b["mask"],
        temperature=temperature,
        ref_logp=b["ref_logp"],
        rollout_logp=b["rollout_logp"],
        cu_seqlens=p["cu"],
        **inputs,
    )


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("source", ["logits", "hidden"])
@pytest.mark.parametrize("name", list(FUSED_CONFIGS))
def test_fused_equals_composition(name, source, packed):
    cfg = rk.PolicyLossConfig(
        **{
            **FUSED_CONFIGS[name],
            "kl_coef": 0.1,
            "entropy_coef": 0.02 if name != "reinforce" else 0.0,
            "rollout_correction": "token_tis",
        }
    )
    p = _problem(seed=len(name), packed=packed)
    torch.manual_seed(0)  # clip_cov draws its tokens from the default generator: the same draw twice
    fused = _fused(cfg, p, source, 0.7)
    torch.manual_seed(0)
    composed = _composed(cfg, p, source, 0.7)
    torch.testing.assert_close(fused.loss, composed.loss, atol=1e-12, rtol=1e-12)
    assert fused.metrics.keys() == composed.metrics.keys()
    leaves = [p["logits"]] if source == "logits" else [p["hidden"], p["weight"], p["bias"]]
    for a, b in zip(
        torch.autograd.grad(fused.loss, leaves), torch.autograd.grad(composed.loss, leaves), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_masked_positions_get_no_logit_gradient():
    p = _problem(seed=3)
    out = _fused(config("ppo", entropy_coef=0.1), p, "logits", 1.0)
    (grad,) = torch.autograd.grad(out.loss, p["logits"])
    off = p["batch"]["mask"] == 0
    assert torch.equal(grad[off], torch.zeros_like(grad[off]))
    assert grad[~off].abs().sum() > 0


def test_entropy_only_when_coefficient_is_nonzero():
    p = _problem(seed=4)
    assert "entropy_mean" not in _fused(config("ppo"), p, "logits", 1.0).metrics
    assert "entropy_mean" in _fused(config("ppo", entropy_coef=0.01), p, "logits", 1.0).metrics


def test_active_out_of_range_id_is_rejected():
    p = _problem(seed=5)
    p["ids"][0, 0] = VOCAB + 1  # position (0, 0) is active
    b = p["batch"]
    kwargs = dict(token_ids=p["ids"], old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"])
    with pytest.raises(ValueError, match="token_ids"):
        rk.fused_policy_loss(config("ppo"), logits=p["logits"], **kwargs)


def test_active_id_equal_to_ignore_index_is_rejected_not_dropped():
    p = _problem(seed=6)
    p["ids"][0, 0] = -100  # position (0, 0) is active: -100 is not a token
    b = p["batch"]
    kwargs = dict(token_ids=p["ids"], old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"])
    with pytest.raises(ValueError, match="active mask positions"):
        rk.fused_policy_loss(config("ppo"), logits=p["logits"], **kwargs)


def test_garbage_logits_at_masked_positions_give_exact_zero_gradient():
    p = _problem(seed=7)
    off = p["batch"]["mask"] == 0
    with torch.no_grad():
        p["logits"][off] = float("nan")
    out = _fused(config("ppo", entropy_coef=0.1), p, "logits", 1.0)
    (grad,) = torch.autograd.grad(out.loss, p["logits"])
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[off], torch.zeros_like(grad[off]))


def test_inplace_backward_option_reaches_the_primitive_and_is_logits_only(monkeypatch):
    import rlkernel.rl.fused as fused_mod

    seen = {}
    real = fused_mod.token_logprobs_checked

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_mod, "token_logprobs_checked", spy)  # seam: spy
    p = _problem(seed=8)
    b = p["batch"]
    kwargs = dict(token_ids=p["ids"], old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"])
    out = rk.fused_policy_loss(config("ppo"), logits=p["logits"], inplace_backward=True, **kwargs)
    assert seen["inplace_backward"] is True and torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="inplace_backward"):
        rk.fused_policy_loss(
            config("ppo"), hidden=p["hidden"], weight=p["weight"], inplace_backward=True, **kwargs
        )


def test_uint8_token_ids_masked_positions_are_ignored_not_wrapped():
    p = _problem(seed=9)
    b = p["batch"]
    ids = torch.where(b["mask"] != 0, p["ids"], 0).to(torch.uint8)
    kwargs = dict(old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"])
    got = rk.fused_policy_loss(config("ppo"), logits=p["logits"], token_ids=ids, **kwargs).loss
    want = rk.fused_policy_loss(config("ppo"), logits=p["logits"], token_ids=ids.long(), **kwargs).loss
    assert torch.equal(got, want)


# ------------------------------------------------------------------ fused token-level (Triton) path
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOKEN_LEVEL = [n for n, c in LOSS_CONFIGS.items() if c["loss_type"] in ("ppo", "cispo", "sapo", "reinforce")]
F32_TOL = dict(atol=2e-6, rtol=2e-5)
# The Triton interpreter evaluates numpy ops on masked lanes (log 0, 0·inf) and warns about them.
interpreter_quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _on_device(p):
    """The problem's logits as fp32 leaves on DEVICE (the kernels' dtype), everything else moved."""
    q = dict(p)
    q["logits"] = p["logits"].detach().float().to(DEVICE).requires_grad_(True)
    q["ids"] = p["ids"].to(DEVICE)
    q["cu"] = None if p["cu"] is None else p["cu"].to(DEVICE)
    q["batch"] = {
        k: v.detach().float().to(DEVICE) if v.is_floating_point() else v.to(DEVICE)
        for k, v in p["batch"].items()
    }
    return q


def _two_pass(set_options, two_pass: bool = False):
    """Force the gradient-in-forward route (``two_pass``) or the 3-pass one, whatever V."""
    set_options(grad_in_forward_max_vocab=1 << 30 if two_pass else 0)
    return 2 if two_pass else 3


def _triton_vs_reference(cfg, p, temperature=0.7, **extra):
    """(fused on the Triton backend, composed on the reference backend) for the same fp32 inputs."""
    with rk.use_backend("triton"):
        fused = _fused(cfg, p, "logits", temperature) if not extra else rk.fused_policy_loss(cfg, **extra)
        (g_fused,) = torch.autograd.grad(fused.loss, p["logits"])
    with rk.use_backend("reference"):
        composed = _composed(cfg, p, "logits", temperature) if not extra else None
        if extra:
            import rlkernel.rl.fused as fused_mod

            composed = fused_mod.fused_policy_loss(cfg, **extra)
        (g_composed,) = torch.autograd.grad(composed.loss, p["logits"])
    return fused, composed, g_fused, g_composed


@interpreter_quiet
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", TOKEN_LEVEL)
@pytest.mark.parametrize("correction", [None, "seq_tis"])
def test_token_level_path_equals_composition(name, packed, two_pass, correction, set_options):
    """Both token-level routes (constants built on the device: padded, no rollout correction; on
    the host otherwise) in both pass counts equal the composed reference."""
    passes = _two_pass(set_options, two_pass)
    cfg = config(name, kl_coef=0.1, entropy_coef=0.02, rollout_correction=correction)
    p = _on_device(_problem(seed=len(name), packed=packed))
    fused, composed, g_fused, g_composed = _triton_vs_reference(cfg, p)
    plan = "device" if correction is None and not packed else "host"
    assert fused.route == Route("logits", "token", "triton", passes=passes, plan=plan), str(fused.route)
    torch.testing.assert_close(fused.loss, composed.loss, **F32_TOL)
    torch.testing.assert_close(g_fused, g_composed, **F32_TOL)
    assert fused.metrics.keys() == composed.metrics.keys()
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], atol=1e-5, rtol=1e-5)


@interpreter_quiet
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_level_path_with_global_normalizers(aggregation, set_options):
    _two_pass(set_options)
    cfg = config("ppo", aggregation=aggregation, kl_coef=0.1, kl_estimator="k3")
    p = _on_device(_problem(seed=12))
    b = p["batch"]
    kw = dict(
        token_ids=p["ids"],
        old_logp=b["old_logp"],
        advantages=b["advantages"],
        mask=b["mask"],
        ref_logp=b["ref_logp"],
        logits=p["logits"],
        global_tokens=31.0,
        global_seqs=torch.tensor(5.0, device=DEVICE),
    )
    fused, composed, g_fused, g_composed = _triton_vs_reference(cfg, p, **kw)
    assert fused.route == Route("logits", "token", "triton", passes=3, plan="device")
    torch.testing.assert_close(fused.loss, composed.loss, **F32_TOL)
    torch.testing.assert_close(g_fused, g_composed, **F32_TOL)


@interpreter_quiet
@pytest.mark.parametrize("estimator", ["k3", "k3_unclamped"])
def test_token_level_path_k3_forms_at_far_drifts(estimator, set_options):
    """k3 with verl's clamps and TRL's unclamped k3 where the clamps bite (ref_logp from −30 to 10
    against log-probs of the logits in about [−8, 0]: ref − logp up to ~18): the fused kernel's KL
    branch equals the composed path."""
    _two_pass(set_options)
    cfg = config("ppo", kl_coef=0.1, kl_estimator=estimator)
    p = _on_device(_problem(seed=13))
    b = p["batch"]
    b["ref_logp"] = torch.linspace(-30.0, 10.0, b["ref_logp"].numel(), device=DEVICE).reshape(b["mask"].shape)
    fused, composed, g_fused, g_composed = _triton_vs_reference(cfg, p)
    assert fused.route.objective == "token"
    torch.testing.assert_close(fused.loss, composed.loss, **F32_TOL)
    torch.testing.assert_close(g_fused, g_composed, **F32_TOL)


SEQUENCE_LEVEL = [n for n, c in LOSS_CONFIGS.items() if n not in TOKEN_LEVEL]


@interpreter_quiet
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", SEQUENCE_LEVEL)
def test_sequence_level_fused_path_equals_composition(name, aggregation, packed):
    extra = dict(kl_coef=0.1, entropy_coef=0.02, rollout_correction="token_tis")
    cfg = config(name, aggregation=aggregation, **extra)
    p = _on_device(_problem(seed=len(name) + len(aggregation), packed=packed))
    fused, composed, g_fused, g_composed = _triton_vs_reference(cfg, p)
    assert fused.route.objective in ("sequence", "autograd") and fused.route.passes == 3
    torch.testing.assert_close(fused.loss, composed.loss, **F32_TOL)
    torch.testing.assert_close(g_fused, g_composed, **F32_TOL)
    assert fused.metrics.keys() == composed.metrics.keys()
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], atol=1e-5, rtol=1e-5)


@interpreter_quiet
@pytest.mark.parametrize(
    ("name", "extra", "path", "plan"),
    [
        ("gspo", {}, "sequence", "device"),  # padded, no rollout correction: the plan on the device
        ("gspo_token", {"rollout_correction": "seq_tis"}, "sequence", "host"),
        ("gmpo", {"entropy_coef": 0.05}, "sequence", "host"),  # packed
        ("gmpo", {"rollout_correction": "token_tis"}, "autograd", None),  # folded per sequence
        ("gspo", {"kl_ratio_weighted": True}, "autograd", None),
    ],
)
def test_sequence_level_closed_form_or_autograd_coefficients(name, extra, path, plan):
    """gspo, gspo_token and gmpo take the closed-form coefficients (rl.seq_token_loss) unless a
    setting needs the autograd algebra; both equal the composed path."""
    cfg = config(name, kl_coef=0.1, **extra)
    p = _on_device(_problem(seed=31 + len(name), packed=path == "sequence" and name == "gmpo"))
    fused, composed, g_fused, g_composed = _triton_vs_reference(cfg, p)
    assert fused.route == Route("logits", path, "triton", passes=3, plan=plan)
    torch.testing.assert_close(fused.loss, composed.loss, **F32_TOL)
    torch.testing.assert_close(g_fused, g_composed, **F32_TOL)
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], atol=1e-5, rtol=1e-5)


@interpreter_quiet
def test_sequence_level_fused_path_with_global_normalizers_and_sliced_logits():
    """gspo from a window of a larger base (the model output's slice): the base gets the whole
    gradient, zero outside the window, equal to the composed path's."""
    cfg = config("gspo", aggregation="seq-mean-token-mean")
    p = _on_device(_problem(seed=21))
    b = p["batch"]
    base = torch.randn(3, 7, VOCAB, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(3))
    base.requires_grad_(True)
    kw = dict(token_ids=p["ids"], old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"],
              global_seqs=torch.tensor(5.0, device=DEVICE))  # fmt: skip
    grads, routes = [], []
    for backend in ("triton", "reference"):
        with rk.use_backend(backend):
            out = rk.fused_policy_loss(cfg, logits=base[:, 1:-1], **kw)
            grads.append((out.loss, *torch.autograd.grad(out.loss, base)))
            routes.append(out.route.objective)
    assert routes == ["sequence", "composed"]
    torch.testing.assert_close(grads[0][0], grads[1][0], **F32_TOL)
    torch.testing.assert_close(grads[0][1], grads[1][1], **F32_TOL)
    assert torch.count_nonzero(grads[0][1][:, 0]) == 0 and torch.count_nonzero(grads[0][1][:, -1]) == 0


@interpreter_quiet
def test_sequence_level_without_grad_keeps_the_composed_path():
    p = _on_device(_problem(seed=22))
    with rk.use_backend("triton"), torch.no_grad():
        out = _fused(config("gspo"), p, "logits", 1.0)
    assert out.route == Route("logits", "composed", "triton", passes=1) and torch.isfinite(out.loss)


@interpreter_quiet
def test_sequence_level_all_masked_gives_zero_loss_and_gradient():
    p = _on_device(_problem(seed=23))
    p["batch"]["mask"] = torch.zeros_like(p["batch"]["mask"])
    with rk.use_backend("triton"):
        out = _fused(config("gmpo", entropy_coef=0.1), p, "logits", 1.0)
        (grad,) = torch.autograd.grad(out.loss, p["logits"])
    assert out.loss.item() == 0.0 and torch.count_nonzero(grad) == 0


@interpreter_quiet
@pytest.mark.parametrize("name", [*MORE_LOSS_CONFIGS, "ppo_kl_ratio_weighted"])
def test_issue14_types_take_the_fused_coefficient_path(name):
    """The loss types without a token-level plan (and the ratio-weighted KL) from logits: the fused
    coefficient path, equal to the composed path on the reference backend."""
    routes = []
    cfg = rk.PolicyLossConfig(**{**FUSED_CONFIGS[name], "kl_coef": 0.1})
    p = _on_device(_problem(seed=13))
    results = []
    for backend in ("triton", "reference"):
        torch.manual_seed(0)
        with rk.use_backend(backend):
            out = _fused(cfg, p, "logits", 0.7)
            results.append((out.loss, torch.autograd.grad(out.loss, p["logits"])[0]))
            routes.append(out.route.objective)
    assert routes[0] in ("sequence", "autograd") and routes[1] == "composed"
    torch.testing.assert_close(results[0][0], results[1][0], **F32_TOL)
    torch.testing.assert_close(results[0][1], results[1][1], **F32_TOL)


@interpreter_quiet
def test_token_level_all_masked_gives_zero_loss_and_gradient():
    p = _on_device(_problem(seed=14))
    p["batch"]["mask"] = torch.zeros_like(p["batch"]["mask"])
    with rk.use_backend("triton"):
        out = _fused(config("ppo", kl_coef=0.1, entropy_coef=0.1), p, "logits", 1.0)
        (grad,) = torch.autograd.grad(out.loss, p["logits"])
    assert out.loss.item() == 0.0 and torch.count_nonzero(grad) == 0


@interpreter_quiet
def test_token_level_garbage_logits_at_masked_positions():
    p = _on_device(_problem(seed=7))
    off = p["batch"]["mask"] == 0
    with torch.no_grad():
        p["logits"][off] = float("nan")
    with rk.use_backend("triton"):
        out = _fused(config("ppo", entropy_coef=0.1, kl_coef=0.1), p, "logits", 1.0)
        (grad,) = torch.autograd.grad(out.loss, p["logits"])
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[off], torch.zeros_like(grad[off]))


@interpreter_quiet
@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 1000, -5])
def test_token_level_out_of_range_id_without_validation_gives_nan(bad_id):
    p = _on_device(_problem(seed=15))
    p["ids"][0, 0] = bad_id  # (0, 0) is active
    with rk.use_backend("triton"):
        b = p["batch"]
        out = rk.fused_policy_loss(
            config("ppo", kl_coef=0.1),
            logits=p["logits"],
            token_ids=p["ids"],
            old_logp=b["old_logp"],
            advantages=b["advantages"],
            mask=b["mask"],
            ref_logp=b["ref_logp"],
            validate=False,
        )
        assert torch.isnan(out.loss)


@interpreter_quiet
def test_token_level_upstream_gradient_and_inplace_backward():
    cfg = config("cispo", entropy_coef=0.05)
    p = _on_device(_problem(seed=16))
    with rk.use_backend("triton"):
        (g1,) = torch.autograd.grad(_fused(cfg, p, "logits", 1.0).loss, p["logits"])
        (g3,) = torch.autograd.grad(-3.0 * _fused(cfg, p, "logits", 1.0).loss, p["logits"])
        torch.testing.assert_close(g3, -3.0 * g1, **F32_TOL)
        leaf = p["logits"].detach().clone().requires_grad_(True)
        b = p["batch"]
        out = rk.fused_policy_loss(
            cfg,
            logits=leaf,
            token_ids=p["ids"],
            old_logp=b["old_logp"],
            advantages=b["advantages"],
            mask=b["mask"],
            inplace_backward=True,
        )
        out.loss.backward()
    torch.testing.assert_close(leaf.grad, g1, **F32_TOL)


# ---------------------------------------------------------- a second backward through a retained graph
# PyTorch's rule: after backward(retain_graph=True), another backward accumulates the same gradients
# again. The fused Triton routes hand out forward-computed buffers or write into the logits; a
# retained graph must get copies (and intact logits) instead, so the sum is exactly twice one.
RETAIN_CONFIGS = {"dapo": config("ppo", kl_coef=0.1, entropy_coef=0.02), "gspo": config("gspo")}


@pytest.fixture
def small_linear_chunks(monkeypatch):
    """16-row chunks for the hidden-state Triton path (4096 padded rows take minutes interpreted)."""
    with rk.use_options(linear_chunk_bytes=16 * VOCAB * 4, linear_grad_bytes=16 * VOCAB * 4):
        yield


def _retain_problem(vocab, seed=40):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, 3, generator=g) > 0.3
    mask[0, 0], mask[1, 2] = True, False
    p = dict(
        ids=torch.where(mask, torch.randint(0, vocab, (2, 3), generator=g), -1),
        old_logp=-torch.rand(2, 3, generator=g) * 2 - 0.1,
        ref_logp=-torch.rand(2, 3, generator=g) * 2 - 0.1,
        advantages=torch.randn(2, generator=g),
        mask=mask,
        logits=torch.randn(2, 3, vocab, generator=g),
        hidden=torch.randn(2, 3, HIDDEN, generator=g),
        weight=torch.randn(vocab, HIDDEN, generator=g) * 0.5,
        bias=torch.randn(vocab, generator=g) * 0.1,
    )
    return {k: v.to(DEVICE) for k, v in p.items()}


def _grads_after(cfg, p, source, backwards, retain=True, **extra):
    """Gradients of fresh leaves after ``backwards`` backward calls through one graph (all but the
    last with retain_graph=``retain``). The logits are an intermediate (leaf · 1), as a model's
    output."""
    names = ("logits",) if source == "logits" else ("hidden", "weight", "bias")
    leaves = [p[n].clone().requires_grad_(True) for n in names]
    inputs = {n: (x * 1.0 if n == "logits" else x) for n, x in zip(names, leaves, strict=True)}
    out = rk.fused_policy_loss(
        cfg,
        token_ids=p["ids"],
        old_logp=p["old_logp"],
        advantages=p["advantages"],
        mask=p["mask"],
        ref_logp=p["ref_logp"],
        **inputs,
        **extra,
    )
    for i in range(backwards):
        out.loss.backward(retain_graph=retain and i < backwards - 1)
    return [x.grad for x in leaves]


@interpreter_quiet
@pytest.mark.parametrize("vocab", [VOCAB, 65_537])  # gradient-in-forward on (V <= 65,536), and off
def test_second_backward_through_a_retained_graph_accumulates_again_logits(vocab):
    p = _retain_problem(vocab)
    for name, cfg in RETAIN_CONFIGS.items():  # gspo: the composed path, through the log-prob primitive
        if name == "gspo" and vocab > VOCAB:  # the primitive's route does not depend on V
            continue
        for backend in ("reference", "triton"):
            for inplace in (False, True):
                with rk.use_backend(backend):
                    (once,) = _grads_after(cfg, p, "logits", 1, inplace_backward=inplace)
                    (twice,) = _grads_after(cfg, p, "logits", 2, inplace_backward=inplace)
                assert torch.count_nonzero(once) > 0
                torch.testing.assert_close(twice, 2 * once, **F32_TOL, msg=f"{name} {backend} {inplace}")


@interpreter_quiet
def test_second_backward_through_a_retained_graph_accumulates_again_hidden(small_linear_chunks):
    p = _retain_problem(VOCAB, seed=41)
    for name, cfg in RETAIN_CONFIGS.items():
        for backend in ("reference", "triton"):
            with rk.use_backend(backend):
                once = _grads_after(cfg, p, "hidden", 1)
                twice = _grads_after(cfg, p, "hidden", 2)
            for a, b in zip(twice, once, strict=True):
                torch.testing.assert_close(a, 2 * b, **F32_TOL, msg=f"{name} {backend}")


@interpreter_quiet
def test_unsupported_second_backward_says_why_and_how_to_avoid_it(
    small_linear_chunks, monkeypatch, set_options
):
    import rlkernel.ops._autograd as fn_mod

    p = _retain_problem(VOCAB, seed=42)
    cfg = RETAIN_CONFIGS["dapo"]
    routes = [  # (source, extra, grad_in_forward_max_vocab, the advice in the message)
        ("logits", {}, 65536, r"use_options\(grad_in_forward_max_vocab=0\)"),
        ("logits", {"inplace_backward": True}, 65536, "inplace_backward=False"),
        ("logits", {"inplace_backward": True}, 0, "inplace_backward=False"),
    ]
    real_graph_retained = getattr(fn_mod, "graph_retained", None)
    with rk.use_backend("triton"):
        for source, extra, vocab_max, advice in routes:
            set_options(grad_in_forward_max_vocab=vocab_max)
            # Two backwards without retain_graph: PyTorch's usual error and advice.
            # seam: fake torch capability
            monkeypatch.setattr(fn_mod, "graph_retained", real_graph_retained, raising=False)
            with pytest.raises(
                RuntimeError, match="backward through the graph a second time.*retain_graph=True"
            ):
                _grads_after(cfg, p, source, 2, retain=False, **extra)
            # A torch that cannot tell a retained graph (< 2.5): the memory-saving route every time,
            # and the second backward explains itself instead of failing obscurely.
            # seam: fake: torch < 2.5
            monkeypatch.setattr(fn_mod, "graph_retained", lambda: None, raising=False)
            with pytest.raises(RuntimeError, match="cannot tell whether a backward retains.*" + advice):
                _grads_after(cfg, p, source, 2, **extra)
        # The hidden route at this size is a whole batch: its backward modifies nothing, so a second
        # backward is right on any torch (the grouped loop's error is tested in tests/ops).
        monkeypatch.setattr(fn_mod, "graph_retained", lambda: None, raising=False)  # seam: torch < 2.5
        twice = _grads_after(cfg, p, "hidden", 2)
        once = _grads_after(cfg, p, "hidden", 1)
        for a, b in zip(twice, once, strict=True):
            torch.testing.assert_close(a, 2 * b, atol=1e-6, rtol=1e-5)


@interpreter_quiet
@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_active_ignore_index_id_without_validation_gives_nan(name):
    """An active id equal to the internal ignore_index (-100) with ``validate=False``: the kernels
    see it as out of range (NaN loss), never as a position to skip."""
    p = _on_device(_problem(seed=24))
    mask = p["batch"]["mask"]
    row, col = (mask != 0).nonzero()[0].tolist()
    p["ids"][row, col] = -100
    with rk.use_backend("triton"):
        b = p["batch"]
        out = rk.fused_policy_loss(
            config(name), logits=p["logits"], token_ids=p["ids"], old_logp=b["old_logp"],
            advantages=b["advantages"], mask=mask, validate=False,
        )  # fmt: skip
    assert torch.isnan(out.loss)
