"""When an expert-parallel engine re-places its experts (EPLB): every ``interval`` forward steps, each
``EPSparseMoE`` layer plans a new placement from the router counts gathered since the last one (summed over
the ep ranks), with ``redundant`` extra slots per layer replicating its hottest experts, and moves the expert
weights (``layers/moe_ep.py``, ``layers/eplb.py``).

Every tp rank executes the same steps in the same order (rank 0 broadcasts each one), so counting executed
forwards puts every rank's re-placement at the same point between two steps, as the all_to_all needs. With the
experts over several data-parallel replicas (``engine/dp_sync.py``) every core runs exactly one forward per
lockstep iteration, its batch or a dummy step, and both are counted here: the whole world of tp x dp ranks
re-places together (the dummy tokens' routes count in the load too, a few tokens against real batches).
Outputs do not change: a token's expert is the same expert, whichever replica serves it.
"""

from __future__ import annotations

from torch import nn

from k3serve.layers.moe_ep import EPSparseMoE


class ExpertRebalancer:
    def __init__(self, model: nn.Module, interval: int, redundant: int):
        self.layers = [m for m in model.modules() if isinstance(m, EPSparseMoE)] if interval else []
        self.interval, self.redundant = interval, redundant
        self.steps = 0
        self.num_rebalances = 0

    def after_step(self) -> None:
        if not self.layers:
            return
        self.steps += 1
        if self.steps % self.interval == 0:
            for layer in self.layers:
                layer.rebalance(self.redundant)
            self.num_rebalances += 1

    @property
    def num_replicas(self) -> int:
        """Expert copies beyond the first of each, over every layer (0 before the first re-placement)."""
        return sum(sum(len(r) - 1 for r in layer.placement.replicas) for layer in self.layers)
