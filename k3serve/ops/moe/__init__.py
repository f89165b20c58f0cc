"""Routed-expert combine: ``naive`` (per token, the spec) and ``grouped`` (padded batched GEMMs), for dense
experts ("expert_combine") and MXFP4-packed experts ("mxfp4_expert_combine")."""

from k3serve.ops.moe.grouped import grouped_expert_combine, mxfp4_expert_combine
from k3serve.ops.moe.naive import naive_expert_combine, naive_mxfp4_expert_combine
from k3serve.ops.registry import register

register("expert_combine", "torch")(grouped_expert_combine)
register("expert_combine", "naive")(naive_expert_combine)
register("mxfp4_expert_combine", "torch")(mxfp4_expert_combine)
register("mxfp4_expert_combine", "naive")(naive_mxfp4_expert_combine)

__all__ = ["grouped_expert_combine", "mxfp4_expert_combine", "naive_expert_combine", "naive_mxfp4_expert_combine"]
