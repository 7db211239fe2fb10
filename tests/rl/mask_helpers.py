"""Glue shared by the tests of on-policy losses, given rollout weights, rollout rejection and the
policy-term masks: the fused-vs-composed problem, a spy on the fused token-level path, and TRL's and
verl's own functions, loaded without their heavy imports.

Framework code: TRL 1.16.0's ``GRPOTrainer`` methods are compiled from the installed
``trl/trainer/grpo_trainer.py`` (its class body, parsed with ``ast``): importing the module pulls
transformers, accelerate and datasets (~8 s of CPU), and the two methods need only torch. verl
0.9.1's ``rollout_corr_helper`` and ``core_algos`` are imported from the installed files with stubs
for what they import but never call on these paths (ray's ``DataProto``, ``tensordict``, the
config classes; verl is installed with ``--no-deps``), present in ``sys.modules`` only during the
import. Both skip when the framework (at that version) is not installed.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types

import pytest
import torch

import rlkernel as rk

from .helpers import make_batch

VOCAB, HIDDEN = 13, 8
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
F32_TOL = dict(atol=2e-6, rtol=2e-5)
F64_TOL = dict(atol=1e-12, rtol=1e-12)
TRL_VERSION, VERL_VERSION = "1.16.0", "0.9.1"
# The Triton interpreter evaluates numpy ops on masked lanes (log 0, 0·inf) and warns about them.
interpreter_quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------------------ fused vs composed problem
def problem(seed=0, packed=False):
    """float64 logits / hidden / LM-head leaves, ids with garbage at masked positions, and the loss
    inputs of :func:`helpers.make_batch` plus fresh positive ``rollout_weights``."""
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(3, 5, seed=seed)
    batch["rollout_weights"] = torch.rand(3, 5, generator=g, dtype=torch.float64) * 1.5 + 0.1
    mask = batch["mask"]
    ids = torch.randint(0, VOCAB, mask.shape, generator=g)
    ids = torch.where(mask, ids, torch.where(torch.rand(mask.shape, generator=g) > 0.5, -1, VOCAB + 7))
    cu = None
    if packed:
        lengths = [5, 2, 4]
        cu = torch.tensor([0, 5, 7, 11])

        def take(x):
            return torch.cat([x[i, :n] for i, n in enumerate(lengths)])

        ids = take(ids)
        batch = {k: (take(v.detach()) if v.dim() == 2 else v) for k, v in batch.items()}
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


def on_device(p):
    """The problem as fp32 on DEVICE (the kernels' dtype), the logits a fresh leaf."""
    q = dict(p)
    q["logits"] = p["logits"].detach().float().to(DEVICE).requires_grad_(True)
    q["ids"] = p["ids"].to(DEVICE)
    q["cu"] = None if p["cu"] is None else p["cu"].to(DEVICE)
    q["batch"] = {
        k: v.detach().float().to(DEVICE) if v.is_floating_point() else v.to(DEVICE)
        for k, v in p["batch"].items()
    }
    return q


LOSS_INPUTS = ("old_logp", "advantages", "mask", "ref_logp", "rollout_logp")


def loss_kwargs(p, **overrides):
    """The keyword inputs of the loss for problem ``p`` (``overrides`` replace or add some)."""
    b = p["batch"]
    kw = {name: b[name] for name in LOSS_INPUTS}
    kw["cu_seqlens"] = p["cu"]
    kw.update(overrides)
    return kw


def fused(cfg, p, source="logits", temperature=0.7, **overrides):
    inputs = (
        {"logits": p["logits"]}
        if source == "logits"
        else {"hidden": p["hidden"], "weight": p["weight"], "bias": p["bias"]}
    )
    return rk.fused_policy_loss(
        cfg, token_ids=p["ids"], temperature=temperature, **inputs, **loss_kwargs(p, **overrides)
    )


def composed(cfg, p, source="logits", temperature=0.7, **overrides):
    """``policy_loss(token_logprobs(...))``: what ``fused_policy_loss`` must equal."""
    kw = loss_kwargs(p, **overrides)
    ids = torch.where(kw["mask"] != 0, p["ids"], -100)
    want_entropy = cfg.entropy_coef != 0 or cfg.top_entropy_quantile < 1
    common = dict(temperature=temperature, return_entropy=want_entropy)
    if source == "logits":
        out = rk.token_logprobs(p["logits"], ids, **common)
    else:
        out = rk.linear_token_logprobs(p["hidden"], p["weight"], ids, bias=p["bias"], **common)
    logp, entropy = out if want_entropy else (out, None)
    old, adv, mask = kw.pop("old_logp"), kw.pop("advantages"), kw.pop("mask")
    return rk.policy_loss(logp, old, adv, mask, cfg, entropy=entropy, **kw)


def leaves(p, source):
    return [p["logits"]] if source == "logits" else [p["hidden"], p["weight"], p["bias"]]


def assert_same(a, b, p, source, tol):
    """Same loss, gradients wrt the source's leaves, and metrics."""
    torch.testing.assert_close(a.loss, b.loss, **tol)
    got = torch.autograd.grad(a.loss, leaves(p, source))
    want = torch.autograd.grad(b.loss, leaves(p, source))
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, **tol)
    assert a.metrics.keys() == b.metrics.keys()
    for key in b.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], atol=1e-5, rtol=1e-5)


def force_passes(set_options, two_pass=False):
    """Force the gradient-in-forward route (``two_pass``) or the 3-pass one whatever V; returns the
    pass count a token-level route then reports (``out.route.passes``)."""
    set_options(grad_in_forward_max_vocab=1 << 30 if two_pass else 0)
    return 2 if two_pass else 3


def triton_vs_reference(cfg, p, **overrides):
    """(fused on the Triton backend, composed on the reference backend) for the same fp32 inputs,
    with their logits gradients."""
    with rk.use_backend("triton"):
        a = fused(cfg, p, **overrides)
        (ga,) = torch.autograd.grad(a.loss, p["logits"])
    with rk.use_backend("reference"):
        b = composed(cfg, p, **overrides)
        (gb,) = torch.autograd.grad(b.loss, p["logits"])
    return a, b, ga, gb


# ------------------------------------------------------------------------------- framework code
def _installed(package: str, version: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    found = importlib.metadata.version(package)
    if found != version:
        pytest.skip(f"{package} {found} is installed; these tests compare with {version}")
    return os.path.dirname(spec.origin)


@functools.cache
def trl_grpo_methods() -> dict:
    """``{name: function}`` of TRL's ``GRPOTrainer.get_off_policy_mask`` and
    ``get_high_entropy_mask``, compiled from the installed source (see the module docstring)."""
    path = os.path.join(_installed("trl", TRL_VERSION), "trainer", "grpo_trainer.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    wanted = ("get_off_policy_mask", "get_high_entropy_mask")
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert sorted(n.name for n in funcs) == sorted(wanted), "TRL's GRPOTrainer changed"
    for fn in funcs:
        fn.decorator_list = []  # @staticmethod: a plain function here
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in wanted}


class OneProcessAccelerator:
    """What ``get_high_entropy_mask`` asks of ``self.accelerator`` in a one-process run."""

    @staticmethod
    def pad_across_processes(t, dim=0, pad_index=0):
        return t

    @staticmethod
    def gather(t):
        return t


@contextlib.contextmanager
def _verl_import_stubs(root: str):
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def package(name, path, **attrs):
        return module(name, __path__=[path], **attrs)

    config_class = type("AlgoConfig", (), {})
    stubs = {
        # bare packages: their __init__ files import ray and the trainer stack (verl.utils's two
        # names serve core_algos' advantage estimators, never called here)
        "verl": package("verl", root),
        "verl.utils": package(
            "verl.utils", os.path.join(root, "utils"), as_torch_index=None, group_mean_std=None
        ),
        "verl.trainer": package("verl.trainer", os.path.join(root, "trainer")),
        "verl.trainer.ppo": package("verl.trainer.ppo", os.path.join(root, "trainer", "ppo")),
        "verl.protocol": module("verl.protocol", DataProto=object),
        "verl.trainer.config": module("verl.trainer.config", AlgoConfig=config_class),
        "verl.trainer.config.algorithm": module(
            "verl.trainer.config.algorithm", RolloutCorrectionConfig=dict
        ),
        "verl.workers": module("verl.workers"),
        "verl.workers.config": module("verl.workers.config", ActorConfig=object),
        "verl.workers.config.actor": module("verl.workers.config.actor", PolicyLossConfig=dict),
    }
    if importlib.util.find_spec("tensordict") is None:
        stubs["tensordict"] = module("tensordict", TensorDict=object)
    saved = {name: sys.modules[name] for name in sys.modules if name == "verl" or name.startswith("verl.")}
    before = set(sys.modules)
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("verl", "tensordict"):
                del sys.modules[name]
        for name in stubs:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


@functools.cache
def verl_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """verl's ``(rollout_corr_helper, core_algos)`` modules (see the module docstring)."""
    root = _installed("verl", VERL_VERSION)
    with _verl_import_stubs(root):
        helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
        core = importlib.import_module("verl.trainer.ppo.core_algos")
    return helper, core


class VerlActorConfig(dict):
    """The attributes ``compute_policy_loss_vanilla`` reads from verl's ActorConfig."""

    def __init__(self, clip_low, clip_high, dual_clip):
        super().__init__(clip_ratio_c=dual_clip)
        self.clip_ratio = clip_low
        self.clip_ratio_low = clip_low
        self.clip_ratio_high = clip_high
        self.global_batch_info = {}
