"""Routed-expert combine: ``naive`` (per token, the spec), ``grouped`` (padded batched GEMMs), ``segmented``
(one GEMM pair per expert, for large batches) and ``dense`` (every expert on every token, for small
batches), for dense experts ("expert_combine": dense, grouped or segmented by batch size) and MXFP4-packed
experts ("mxfp4_expert_combine": grouped), and ``gathered`` (each token's k experts' weights gathered: no host-side
counts, for the static decode step; ops "expert_combine_static" / "mxfp4_expert_combine_static"). Backend "grouped" of "expert_combine" always takes the padded form.
Where Triton is installed (the ``[gpu]`` extra), "mxfp4_expert_combine" also has backend "triton" (two grouped
GEMMs over the packed weights, activation fused; ``triton_mxfp4.py``), which dispatch picks for CUDA tensors."""

from importlib.util import find_spec

from k3serve.ops.moe.dense import dense_expert_combine, expert_combine
from k3serve.ops.moe.gathered import gathered_expert_combine, gathered_mxfp4_expert_combine
from k3serve.ops.moe.grouped import grouped_expert_combine, mxfp4_expert_combine
from k3serve.ops.moe.naive import naive_expert_combine, naive_mxfp4_expert_combine
from k3serve.ops.moe.segmented import segmented_expert_combine
from k3serve.ops.registry import register

register("expert_combine", "torch")(expert_combine)
register("expert_combine", "naive")(naive_expert_combine)
register("expert_combine", "grouped")(grouped_expert_combine)  # GPU training: fewest ops
register("expert_combine_static", "torch")(gathered_expert_combine)
register("expert_combine_static", "naive")(naive_expert_combine)
register("mxfp4_expert_combine_static", "torch")(gathered_mxfp4_expert_combine)
register("mxfp4_expert_combine_static", "naive")(naive_mxfp4_expert_combine)
register("mxfp4_expert_combine", "torch")(mxfp4_expert_combine)
register("mxfp4_expert_combine", "naive")(naive_mxfp4_expert_combine)
if find_spec("triton") is not None:  # the [gpu] extra; a CPU install never imports it
    from k3serve.ops.moe import triton_mxfp4

    register("mxfp4_expert_combine", "triton", priority=20, accepts=triton_mxfp4.accepts)(
        triton_mxfp4.triton_mxfp4_expert_combine)

__all__ = ["dense_expert_combine", "expert_combine", "gathered_expert_combine", "gathered_mxfp4_expert_combine", "grouped_expert_combine", "mxfp4_expert_combine",
           "naive_expert_combine", "naive_mxfp4_expert_combine", "segmented_expert_combine"]
