"""Non-finite inputs and degenerate global normalizers, on every path that computes the loss.

* NaN, +inf or −inf at an *active* position of an input the loss reads gives a NaN loss — never a
  finite one absorbed by the log-ratio clamp, the k3 clamps or a truncated/rejected rollout weight —
  on ``policy_loss``, on ``fused_policy_loss`` from logits and from hidden states, on the reference
  and the Triton backends (the Triton kernels run in the CPU interpreter here). At masked positions
  the same values contribute exactly 0 (loss and gradient).
* A step that is all-masked on every rank has global normalizers of 0 (``global_normalizers``): each
  of its micro-batches gives loss 0 and zero gradients, on every path, as without normalizers. A
  normalizer of 0 (or negative, or not finite) while the call has active tokens gives NaN.
"""

import pytest
import torch

import rlkernel as rk
from rlkernel.rl.config import PRESETS

from .helpers import LOSS_CONFIGS, config

B, T, V, H = 3, 4, 13, 8
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the Triton interpreter
NONFINITE = (float("inf"), -float("inf"), float("nan"))
CONSTANTS = ("old_logp", "ref_logp", "rollout_logp")
ACTIVE = (0, 0)  # always active in _problem
# The Triton interpreter evaluates numpy ops on masked lanes (log 0, 0·inf, inf − inf) and warns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def small_linear_chunks(monkeypatch):
    """16-row chunks and groups for the hidden-state Triton path (the default, 4096 padded rows,
    takes minutes in the interpreter)."""
    with rk.use_options(linear_chunk_bytes=16 * V * 4, linear_grad_bytes=16 * V * 4):
        yield


def _problem(seed: int) -> dict:
    """Fresh random fp32 inputs (no zeros): a mask with (0, 0) active, row 1 partly masked and at
    least one masked position per row 2; ids with garbage (-1) at masked positions."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    mask[1, 1:3] = False
    mask[2, -1] = False
    logp = -torch.rand(B, T, generator=g) * 3 - 0.05
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    ids = torch.where(mask, torch.randint(0, V, (B, T), generator=g), -1)
    p = dict(
        mask=mask,
        ids=ids,
        logp=logp,
        old_logp=old,
        ref_logp=logp + 0.4 * torch.randn(B, T, generator=g),
        rollout_logp=old + 0.2 * torch.randn(B, T, generator=g),
        entropy=torch.rand(B, T, generator=g) * 2 + 0.1,
        advantages=torch.randn(B, generator=g),
        logits=torch.randn(B, T, V, generator=g),
        hidden=torch.randn(B, T, H, generator=g),
        weight=torch.randn(V, H, generator=g) * 0.5,
        bias=torch.randn(V, generator=g) * 0.1,
    )
    return {k: v.to(DEVICE) for k, v in p.items()}


PATHS = (
    "policy_loss",
    "logits-reference",
    "logits-triton",
    "logits-triton-3pass",
    "hidden-reference",
    "hidden-triton",
)


def _run(path: str, cfg, p: dict, monkeypatch, **normalizers):
    """(loss, {leaf name: gradient}) of ``cfg`` on ``p`` along ``path``."""
    common = dict(
        old_logp=p["old_logp"],
        advantages=p["advantages"],
        mask=p["mask"],
        ref_logp=p["ref_logp"],
        rollout_logp=p["rollout_logp"],
        **normalizers,
    )
    if path == "policy_loss":
        leaves = {"logp": p["logp"].clone().requires_grad_(True)}
        leaves["entropy"] = p["entropy"].clone().requires_grad_(True)
        out = rk.policy_loss(leaves["logp"], cfg=cfg, entropy=leaves["entropy"], **common)
    else:
        source, backend = path.split("-")[:2]
        two_pass_max_vocab = 0 if path.endswith("3pass") else 65536
        names = ("logits",) if source == "logits" else ("hidden", "weight", "bias")
        leaves = {n: p[n].clone().requires_grad_(True) for n in names}
        with rk.use_backend(backend), rk.use_options(grad_in_forward_max_vocab=two_pass_max_vocab):
            out = rk.fused_policy_loss(cfg, token_ids=p["ids"], **leaves, **common)
    loss = out.loss
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves.values(), strict=True)]
    return loss.detach(), dict(zip(leaves, grads, strict=True))


def _masked_rows_have_zero_gradient(grads: dict, mask: torch.Tensor) -> None:
    off = ~mask
    for name in ("logp", "entropy", "logits", "hidden"):
        if name in grads:
            g = grads[name][off]
            assert torch.equal(g, torch.zeros_like(g)), f"{name}: nonzero gradient at masked positions"


def _reading_all(name: str) -> rk.PolicyLossConfig:
    """Preset ``name`` with a KL term and a rollout correction, so that the loss reads old_logp,
    ref_logp and rollout_logp (the preset's own KL settings are kept when it has them)."""
    kl = {} if PRESETS[name].get("kl_coef", 0) > 0 else {"kl_coef": 0.05}
    return rk.PolicyLossConfig.preset(name, rollout_correction="token_tis", **kl)


# ------------------------------------------------------------------------------ non-finite inputs
def _masked_garbage_changes_nothing(cfg, monkeypatch, seed: int) -> None:
    """+inf, −inf and NaN at the masked positions of old/ref/rollout log-probs leave the loss and
    the gradients bitwise unchanged, on every path."""
    clean = _problem(seed)
    off = (~clean["mask"]).nonzero()
    # +inf, −inf, NaN in turn
    garbage = torch.tensor(NONFINITE, device=off.device).repeat(len(off))[: len(off)]
    dirty = dict(clean)
    for where in CONSTANTS:
        dirty[where] = clean[where].index_put((off[:, 0], off[:, 1]), garbage)
    for path in ("policy_loss", "logits-reference", "logits-triton", "hidden-triton"):
        loss, grads = _run(path, cfg, clean, monkeypatch)
        loss_d, grads_d = _run(path, cfg, dirty, monkeypatch)
        assert torch.isfinite(loss) and torch.equal(loss, loss_d), path
        for key in grads:
            assert torch.equal(grads[key], grads_d[key]), (path, key)
        _masked_rows_have_zero_gradient(grads_d, clean["mask"])


@pytest.mark.parametrize("where", CONSTANTS)
@pytest.mark.parametrize("name", list(PRESETS))
def test_nonfinite_constant_at_an_active_token_gives_nan(name, where, monkeypatch):
    cfg = _reading_all(name)
    if where == CONSTANTS[0]:  # once per preset: the same values at masked positions are ignored
        _masked_garbage_changes_nothing(cfg, monkeypatch, seed=31 + len(name))
    for value in NONFINITE:
        p = _problem(seed=7 * len(name) + CONSTANTS.index(where))
        p[where][ACTIVE] = value
        for other in CONSTANTS:  # garbage at every masked position too
            p[other] = p[other].masked_fill(~p["mask"], value)
        paths = ["policy_loss", "logits-reference", "logits-triton"]
        if value == float("inf"):  # the hidden-state paths (and the 3-pass kernel) once
            paths += ["logits-triton-3pass", "hidden-reference", "hidden-triton"]
        for path in paths:
            loss, grads = _run(path, cfg, p, monkeypatch)
            assert torch.isnan(loss), f"{path}: {where}={value} at an active token gave loss {loss}"
            _masked_rows_have_zero_gradient(grads, p["mask"])


@pytest.mark.parametrize("mode", ["token_tis", "seq_tis", "token_mis", "seq_mis"])
def test_nonfinite_rollout_logp_gives_nan_for_every_correction(mode, monkeypatch):
    bounds = {"rollout_clip_min": 0.5, "rollout_clip_max": 2.0}
    for loss_type in ("ppo", "gmpo"):  # gmpo folds token weights per sequence
        cfg = config(loss_type, rollout_correction=mode, **bounds)
        paths = ("policy_loss", "logits-triton-3pass") if loss_type == "ppo" else ("policy_loss",)
        for value in NONFINITE:
            for where in ("rollout_logp", "old_logp"):
                p = _problem(seed=3)
                p[where][ACTIVE] = value
                for path in paths:
                    loss, _ = _run(path, cfg, p, monkeypatch)
                    assert torch.isnan(loss), (loss_type, mode, where, value, path)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "k1+", "k3+", "k3_unclamped"])
def test_nonfinite_ref_logp_gives_nan_for_every_kl_estimator(estimator, monkeypatch):
    cfg = config("ppo", kl_coef=0.1, kl_estimator=estimator)
    for value in NONFINITE:
        p = _problem(seed=4)
        p["ref_logp"][ACTIVE] = value
        for path in ("policy_loss", "logits-triton"):
            loss, _ = _run(path, cfg, p, monkeypatch)
            assert torch.isnan(loss), (estimator, value, path)
        logp = p["logp"].requires_grad_(True)
        kl = rk.kl_penalty(logp, p["ref_logp"], estimator)
        assert torch.isnan(kl[ACTIVE]) and torch.isfinite(kl.flatten()[1:]).all()
        (g,) = torch.autograd.grad(kl.sum(), logp)
        assert torch.isfinite(g.flatten()[1:]).all()


def test_kl_penalty_nonfinite_logp_gives_nan():
    logp = -torch.rand(6, device=DEVICE) - 0.1
    ref = logp + 0.3 * torch.randn(6, device=DEVICE)
    for value in NONFINITE:
        x = logp.clone()
        x[2] = value
        for estimator in ("k1", "k2", "k3", "abs", "k1+", "k3+", "k3_unclamped"):
            out = rk.kl_penalty(x, ref, estimator)
            assert torch.isnan(out[2]) and torch.isfinite(out[torch.arange(6, device=DEVICE) != 2]).all()


@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_nonfinite_logp_advantage_or_entropy_gives_nan(name, monkeypatch):
    cfg = config(name, entropy_coef=0.02)
    for value in NONFINITE:
        for where in ("logp", "advantages", "entropy"):
            p = _problem(seed=11)
            if where == "advantages":
                p["advantages"][0] = value
            else:
                p[where][ACTIVE] = value
            loss, grads = _run("policy_loss", cfg, p, monkeypatch)
            assert torch.isnan(loss), (where, value)
            _masked_rows_have_zero_gradient(grads, p["mask"])
    # From logits: logp = −inf where the sampled token's logit is −inf.
    p = _problem(seed=12)
    p["logits"][ACTIVE + (int(p["ids"][ACTIVE]),)] = -float("inf")
    for path in ("logits-reference", "logits-triton"):
        loss, grads = _run(path, cfg, p, monkeypatch)
        assert torch.isnan(loss), (path, name)
        _masked_rows_have_zero_gradient(grads, p["mask"])


def test_reinforce_does_not_read_old_logp_on_any_path(monkeypatch):
    # −A·logp: old_logp only feeds the metrics. Both backends agree (the kernel used to flag it).
    cfg = config("reinforce")
    p = _problem(seed=13)
    p["old_logp"][ACTIVE] = float("nan")
    for path in ("policy_loss", "logits-reference", "logits-triton", "hidden-triton"):
        loss, _ = _run(path, cfg, p, monkeypatch)
        assert torch.isfinite(loss), path


# ------------------------------------------------------------------- degenerate global normalizers
def _all_masked(seed: int) -> dict:
    p = _problem(seed)
    p["mask"] = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    return p


@pytest.mark.parametrize("name", list(PRESETS))
def test_all_masked_step_with_global_normalizers_gives_zero(name, monkeypatch):
    cfg = rk.PolicyLossConfig.preset(name, kl_coef=0.05, entropy_coef=0.01, rollout_correction="seq_tis")
    p = _all_masked(seed=20 + len(name))
    tokens, seqs = rk.global_normalizers(p["mask"])
    assert tokens.item() == 0 and seqs.item() == 0
    variants = [dict(global_tokens=tokens, global_seqs=seqs)]
    if name == "grpo":  # the other spellings of 0: Python numbers, integer tensors
        variants += [
            dict(global_tokens=0, global_seqs=0.0),
            dict(global_tokens=torch.tensor(0, device=DEVICE), global_seqs=0),
        ]
    for normalizers in variants:
        for path in PATHS:
            loss, grads = _run(path, cfg, p, monkeypatch, **normalizers)
            assert loss.item() == 0.0 and not torch.isnan(loss), (path, normalizers)
            for key, g in grads.items():
                assert torch.equal(g, torch.zeros_like(g)), (path, key)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_zero_or_invalid_global_normalizer_with_active_tokens_gives_nan(aggregation, monkeypatch):
    # 0 is the count of a step without active tokens: with active tokens here it is inconsistent, and
    # a tensor's value cannot be checked on the host without a sync; the loss says so with NaN.
    cfg = config("ppo", aggregation=aggregation)
    p = _problem(seed=21)
    for bad in (0, *(torch.tensor(x, device=DEVICE) for x in (0.0, -4.0, float("inf")))):
        paths = PATHS if isinstance(bad, int) or bad.item() == 0 else ("policy_loss", "logits-triton")
        for path in paths:
            loss, _ = _run(path, cfg, p, monkeypatch, global_tokens=bad, global_seqs=bad)
            assert torch.isnan(loss), (path, bad)
