"""``rlkernel.integrations``: rlkernel as a drop-in where users train (DESIGN.md, "Integrations").

Each integration is a submodule, imported on its own (this package imports none of them). None
imports its framework when imported, except where registering in the framework is its job (verl) or
a class must subclass the framework's (TRL's trainer, imported on first use):

    openrlhf    PolicyLoss: OpenRLHF 0.11.2's ``openrlhf.models.loss.PolicyLoss`` (same constructor,
                ``forward`` and return values), computed by :func:`rlkernel.policy_loss`
                (docs/integrations/openrlhf.md). It never imports OpenRLHF (it reads the installed
                version only).
    verl        importing it registers ``rk_<mode>`` policy losses in verl 0.9.1's registry and an
                ``impl_backend: rlkernel`` fused forward (docs/integrations/verl.md). It imports
                verl: registering in verl's registry is its job, and verl's workers import it by
                name (``actor_rollout_ref.model.external_lib``).
    trl         RLKernelGRPOTrainer: TRL 1.16's ``GRPOTrainer`` with the loss computed by
                :func:`rlkernel.fused_policy_loss` from hidden states; policy_config_from_trl;
                add_rlkernel_lm_head (docs/integrations/trl.md)

An integration maps the framework's settings onto :class:`rlkernel.PolicyLossConfig` and the global
normalizers, states the framework versions it is tested with, and raises at construction for a
setting it cannot reproduce exactly. Its tests compare it with the framework's real code.

This is the top layer of the package: it may use everything below it (the public API, ``rl``), and
nothing in ``rlkernel`` imports it (``tests/test_layering.py``).
"""
