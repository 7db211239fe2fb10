"""Import verl (and ``rlkernel.integrations.verl``) in the tests without verl's distributed stack.

``make setup-dev`` installs the verl 0.9.1 wheel with ``pip install --no-deps`` plus the two light
packages its loss path imports (omegaconf, codetiming). The import-time stubs for ray, tensordict and
orjson live in :mod:`rlkernel.integrations.verl_without_ray` (what ``examples/verl_policy_loss.py``
uses too; its docstring says what and why); this module adds the tests' skip/fail rule.

The verl tests skip when verl 0.9.1 is not installed, except under ``CI``, where they fail: CI must
never pass without comparing against the real code.
"""

from __future__ import annotations

import os

from rlkernel.integrations.verl_without_ray import INSTALL, VERL_VERSION, import_verl, unavailable_reason

__all__ = ["INSTALL", "VERL_VERSION", "import_verl", "in_ci", "unavailable_reason"]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")
