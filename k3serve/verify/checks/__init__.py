"""The checks, one module per area; importing this package registers them all in ``base.CHECKS`` in run order."""

from k3serve.verify.checks import params, tools, thinking, k3, usage, fidelity  # noqa: F401  (registration)
from k3serve.verify.checks.base import CHECKS, Check, Ctx, Fail, Result, Target, Unsupported

__all__ = ["CHECKS", "Check", "Ctx", "Fail", "Result", "Target", "Unsupported"]
