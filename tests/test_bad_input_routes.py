"""Bad input of the route types (issue 28): a ``Route`` outside its values, ``record_routes``
called with arguments."""

from __future__ import annotations

import pytest

import rlkernel as rk

COVERED = [rk.Route, rk.record_routes]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(source="embeddings", objective="token", kernels="triton"), "Route.source"),
        (dict(source="logits", objective="fused", kernels="triton"), "Route.objective"),
        (dict(source="logits", objective="token", kernels="cuda"), "Route.kernels"),
        (dict(source="logits", objective="token", kernels="triton", plan="gpu"), "Route.plan"),
        (dict(source="hidden", objective="token", kernels="triton", gemm="cutlass"), "Route.gemm"),
        (dict(source="hidden", objective="token", kernels="triton", grouping="all"), "Route.grouping"),
        (dict(source="logits", objective="token", kernels="triton", passes=0), "Route.passes"),
        (dict(source="logits", objective="token", kernels="triton", passes=True), "Route.passes"),
    ],
)
def test_route_rejects_values_outside_its_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rk.Route(**kwargs)


def test_route_vocab_parallel_must_be_a_bool():
    with pytest.raises(TypeError, match="vocab_parallel"):
        rk.Route("hidden", "composed", "triton", vocab_parallel="yes")


def test_record_routes_takes_no_arguments():
    with pytest.raises(TypeError):
        rk.record_routes("all")
