"""verl: rlkernel's policy losses in verl's registry, and an rlkernel backend for its fused forward.

Importing this package (it imports verl) does two things, once per process
(docs/integrations/verl.md):

1. **Policy losses.** For each row of :data:`LOSS_MODES`, and for :data:`BYPASS_MODE`, it registers
   ``rk_<mode>`` in ``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``: a function with the
   signature, defaults and return values of verl's own ``<mode>`` loss, computed by
   :func:`rlkernel.policy_loss` (:mod:`.losses`; ``bypass_mode``'s rollout IS weights and rejection
   by :mod:`rlkernel.rl.rollout`, :mod:`.bypass`). Before registering, it runs verl's own function on
   a probe batch to find how the installed verl aggregates each ``loss_agg_mode`` (:mod:`.probe`);
   what it cannot reproduce raises a ``RuntimeError`` saying so when called. :data:`PLANS` records
   what was found.

       rk_vanilla  rk_gspo  rk_sapo  rk_cispo  rk_geo_mean  rk_gpg  rk_dro
       rk_dppo_tv  rk_dppo_kl  rk_clip_cov  rk_kl_cov  rk_bypass_mode

2. **Fused forward.** It wraps verl's ``patch_forward_with_backends`` so that
   ``fused_kernel_options.impl_backend: rlkernel`` (with ``use_fused_kernels: true``) makes the
   model's forward :func:`forward_with_rlkernel_backend`: log-probs and entropy from the hidden
   states by :func:`rlkernel.linear_token_logprobs` (:mod:`.forward`).

verl's workers import it when the config names it:

    actor_rollout_ref.model.external_lib=rlkernel.integrations.verl
    actor_rollout_ref.actor.policy_loss.loss_mode=rk_vanilla

In verl's bypass mode (``algorithm.rollout_correction.bypass_mode=true``) verl's trainer sets
``loss_mode=bypass_mode`` itself; ``rk_bypass_mode`` is chosen by overriding it after that (see
docs/integrations/verl.md). Tested with verl 0.9.1 (:data:`TESTED_VERSIONS`; CI compares every mode
and aggregation with its code).

Raises (at import):
    ImportError: verl (or what its package imports: ray, tensordict) is not installed.
    RuntimeError: the installed verl has no policy-loss registry or an ``ActorConfig`` this module
        cannot build (an unsupported verl version).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from rlkernel.integrations.verl import forward, losses, probe
from rlkernel.integrations.verl.bypass import BYPASS_MODE
from rlkernel.integrations.verl.forward import (
    FUSED_BACKEND,
    forward_with_rlkernel_backend,
    install_fused_forward,
)
from rlkernel.integrations.verl.losses import LOSS_MODES, ModePlan

__all__ = [
    "BYPASS_MODE",
    "FUSED_BACKEND",
    "LOSS_MODES",
    "PLANS",
    "RK_LOSSES",
    "TESTED_VERSIONS",
    "forward_with_rlkernel_backend",
    "install_fused_forward",
]

# The verl releases CI compares against (the probe decides what other versions get).
TESTED_VERSIONS: tuple[str, ...] = ("0.9.1",)


def _installed_version() -> str:
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(importlib.import_module("verl"), "__version__", "unknown"))


def _probe_config_factory(version: str) -> Callable[[Mapping], Any]:
    """``global_batch_info`` → a verl ``ActorConfig`` with the probe's settings."""
    workers_config = importlib.import_module("verl.workers.config")
    actor_config = getattr(workers_config, "ActorConfig", None)
    policy_loss_config = getattr(workers_config, "PolicyLossConfig", None)

    def make_config(info: Mapping) -> Any:
        nested = {}
        if dataclasses.is_dataclass(policy_loss_config):  # dro's β (a verl without the field: none)
            known = {f.name for f in dataclasses.fields(policy_loss_config)}
            values = {k: v for k, v in probe.PROBE_POLICY_LOSS.items() if k in known}
            nested = dict(policy_loss=policy_loss_config(**values))
        return actor_config(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            global_batch_info=dict(info),
            **nested,
            **probe.PROBE_SETTINGS,
        )

    try:
        make_config({})
    except Exception as error:  # any failure means this verl's ActorConfig is not the one we know
        raise RuntimeError(
            f"rlkernel.integrations.verl cannot build the installed verl {version}'s ActorConfig (to probe "
            f"its losses): {type(error).__name__}: {error}. Tested with verl {', '.join(TESTED_VERSIONS)}."
        ) from error
    return make_config


def _register() -> tuple[Mapping[str, ModePlan], Mapping[str, Callable]]:
    """Probe and register every row of :data:`LOSS_MODES`; hook the fused-forward backend."""
    version = _installed_version()
    core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
    registry = getattr(core_algos, "POLICY_LOSS_REGISTRY", None)
    register = getattr(core_algos, "register_policy_loss", None)
    if not isinstance(registry, dict) or not callable(register):
        raise RuntimeError(
            f"rlkernel.integrations.verl: the installed verl {version} has no policy-loss registry "
            "(core_algos.POLICY_LOSS_REGISTRY and register_policy_loss); tested with verl "
            f"{', '.join(TESTED_VERSIONS)}"
        )
    make_config = _probe_config_factory(version)
    plans, functions = {}, {}
    for mode in (*LOSS_MODES, BYPASS_MODE):
        plan = probe.plan_mode(mode, registry.get(mode.verl_name), make_config, version)
        functions[mode.name] = register(mode.name)(losses.make_policy_loss_fn(plan))
        plans[mode.name] = plan
    forward.hook_patch_forward_with_backends(importlib.import_module("verl.models.transformers.monkey_patch"))
    return MappingProxyType(plans), MappingProxyType(functions)


# rk name -> what the probe decided (its conventions per loss_agg_mode, what is refused and why),
# and rk name -> the registered function (the one verl's get_policy_loss_fn returns).
PLANS, RK_LOSSES = _register()
