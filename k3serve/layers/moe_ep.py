"""Expert-parallel MoE: each ep rank holds some experts; tokens travel to them and their outputs come back.

The ``tp`` ranks of one dp group hold the same tokens x ``[N, d]`` (attention runs replicated or tensor-parallel
before the MoE), so tp rank r takes its own contiguous chunk of ``n_r ≈ N / tp`` tokens. The ep ranks are that
tp group (ep == tp) or every rank of every dp group (ep == tp * dp: each dp group has its own batch and N, zero
when it is idle; its ranks still join every exchange with empty parts):
  weights, ids = router(x_r)                        ``[n_r, k]`` (router replicated on every rank)
  u = W_down x_r                                    ``[n_r, ℓ]`` (LatentMoE: the exchange is ℓ wide, not d)
  dispatch: assignment (t, j) -> a replica of expert ids[t, j] = (rank, local slot) (``eplb.Placement``);
      each token's row once per destination rank, all_to_all    each rank receives ``[m, ℓ]`` + (row, slot) ids
  LocalExperts: y = expert_slot(row) for every received row, through the ops/moe backends (k = 1, weight 1)
  combine: all_to_all back, then Σ_j w_tj · y_tj in slot order, fp32 ``[n_r, ℓ]`` (the single-process sum)
  RMSNorm_ℓ, then all-gather the chunks over the tp group (also ℓ wide) -> ``[N, ℓ]``, W_up and the shared
  experts replicated.
With one rank this is the single-process ``SparseMoE`` computation step for step.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.distributed import Parallel, all_gather_rows, all_to_all, ep_all_reduce, exchange_counts
from k3serve.layers.eplb import ExpertLoad, Placement, block_placement, plan_placement, split_counts
from k3serve.layers.moe import GatedMLP, MoEGate, RoutedExperts, SparseMoE, add_latent_projections
from k3serve.layers.weights import WeightSlot, foreign_slot

_EXPERT_TENSORS = ("experts.w13", "experts.w2", "experts.w13_packed", "experts.w13_scale", "experts.w2_packed",
                   "experts.w2_scale")


class LocalExperts(RoutedExperts):
    """This rank's expert slots: slot i holds logical expert ``experts[i]`` (a hot expert may sit in several
    ranks' slots). Checkpoint keys are the logical ones; the other experts' keys load as foreign slots."""

    def __init__(self, cfg: TextConfig, mxfp4: bool, experts: tuple[int, ...]):
        super().__init__(cfg, mxfp4, num_experts=len(experts))
        self.global_ids, self.total_experts = experts, cfg.num_experts

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        slots = []
        for e in range(self.total_experts):
            p = f"{prefix}{e}."
            mine = [i for i, g in enumerate(self.global_ids) if g == e]
            if not mine:
                slots += [foreign_slot(s.key, s) for s in self.expert_slots(0, p)]
                continue
            copies = [self.expert_slots(i, p) for i in mine]
            slots += [_fan_out(group) for group in zip(*copies)]
        return slots

    def expert_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by expert slot (``[slots, ...]``)."""
        if self.mxfp4:
            return [self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale]
        return [self.w13, self.w2]


def _fan_out(group: tuple[WeightSlot, ...]) -> WeightSlot:
    """One checkpoint tensor loaded into every local slot that replicates its expert."""
    if len(group) == 1:
        return group[0]

    def load(t: torch.Tensor) -> None:
        for s in group:
            s.load(t)

    return WeightSlot(group[0].key, group[0].shape, group[0].dtype, load, group[0].dump)


def ep_state_dict(full: dict[str, torch.Tensor], placement: Placement, rank: int) -> dict[str, torch.Tensor]:
    """A single-process ``SparseMoE`` state dict cut to what ``EPSparseMoE`` on ``rank`` holds: the routed
    expert tensors ``[E, ...]`` keep this rank's slots (``[slots, ...]``), everything else is replicated."""
    slots = torch.tensor(placement.experts_of_rank[rank])
    return {k: (v.index_select(0, slots) if k.endswith(_EXPERT_TENSORS) else v) for k, v in full.items()}


class EPSparseMoE(nn.Module):
    """``SparseMoE`` with its routed experts spread over the ep ranks (same checkpoint keys, see the module
    docstring). ``placement`` defaults to contiguous blocks of E / ep experts."""

    def __init__(self, cfg: TextConfig, mxfp4: bool, par: Parallel, placement: Placement | None = None):
        super().__init__()
        d = cfg.hidden_size
        self.par = par
        self.placement = placement or block_placement(cfg.num_experts, par.ep)
        if self.placement.num_ranks != par.ep or self.placement.num_experts != cfg.num_experts:
            raise ValueError(f"placement is for {self.placement.num_experts} experts on {self.placement.num_ranks} "
                             f"ranks, the layer has {cfg.num_experts} experts on {par.ep} ep ranks")
        self.gate = MoEGate(d, cfg)
        self.experts = LocalExperts(cfg, mxfp4, self.placement.experts_of_rank[par.ep_rank])
        add_latent_projections(self, cfg)
        self.shared_experts = (GatedMLP(d, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg)
                               if cfg.num_shared_experts else None)
        self.expert_load = ExpertLoad(cfg.num_experts)  # EPLB statistics: this rank's routed tokens
        # bytes this rank received from other ranks (dispatch: rows + slot ids; combine: expert outputs;
        # gather: the other ranks' normalised chunks), and the tokens it routed
        self.traffic = {"dispatch_bytes": 0, "combine_bytes": 0, "gather_bytes": 0, "tokens": 0}
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _replica_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(replica count ``[E]``, rank ``[E, max_rep]``, local slot ``[E, max_rep]``); built lazily because the
        module may be built on the meta device."""
        if device not in self._tables:
            reps = self.placement.replicas
            width = max(len(r) for r in reps)
            ranks = [[r for r, _ in rep] + [0] * (width - len(rep)) for rep in reps]
            slots = [[s for _, s in rep] + [0] * (width - len(rep)) for rep in reps]
            self._tables[device] = (torch.tensor([len(r) for r in reps], device=device),
                                    torch.tensor(ranks, device=device), torch.tensor(slots, device=device))
        return self._tables[device]

    def _destinations(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each assignment's (ep rank, local slot). An expert with n replicas sends its i-th assignment here to
        replica (i + rank) mod n: even to within one row per source rank, and the source ranks' leftovers go
        to different replicas."""
        num_rep, rep_rank, rep_slot = self._replica_tables(flat.device)
        if int(num_rep.max()) == 1:
            return rep_rank[:, 0].index_select(0, flat), rep_slot[:, 0].index_select(0, flat)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=num_rep.numel())
        run_start = (counts.cumsum(0) - counts).index_select(0, flat.index_select(0, order))
        occurrence = torch.empty_like(flat).index_copy_(0, order, torch.arange(flat.numel(), device=flat.device)
                                                        - run_start)
        rep = (occurrence + self.par.ep_rank) % num_rep.index_select(0, flat)
        return rep_rank[flat, rep], rep_slot[flat, rep]

    def dispatch_combine(self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """u ``[n, D]`` (D = ℓ for LatentMoE), weights / ids ``[n, k]`` -> ``Σ_k w_k · expert(u)`` ``[n, D]`` fp32,
        each expert evaluated on the rank holding it. A token goes once to each rank that holds any of its
        experts (with one int32 (row, slot) pair per assignment); results come back one row per assignment."""
        par, (n, k), D = self.par, ids.shape, u.shape[1]
        dest_rank, dest_slot = self._destinations(ids.reshape(-1))
        token = torch.arange(n * k, device=u.device).div(k, rounding_mode="floor")
        # assignments by (rank, token), slots in order inside: a token's assignments to one rank are adjacent
        order = (dest_rank * n + token).argsort(stable=True)
        rank_sorted, token_sorted = dest_rank.index_select(0, order), token.index_select(0, order)
        first = torch.ones_like(order, dtype=torch.bool)
        first[1:] = (rank_sorted[1:] != rank_sorted[:-1]) | (token_sorted[1:] != token_sorted[:-1])
        send_rows = torch.bincount(rank_sorted[first], minlength=par.ep)
        row = first.cumsum(0) - 1 - (send_rows.cumsum(0) - send_rows).index_select(0, rank_sorted)
        send = torch.bincount(dest_rank, minlength=par.ep).tolist()
        recv, recv_rows = exchange_counts(send, par), exchange_counts(send_rows.tolist(), par)
        rows = all_to_all(u.index_select(0, token_sorted[first]), send_rows.tolist(), recv_rows, par)
        meta = all_to_all(torch.stack([row, dest_slot.index_select(0, order)], 1).int(), send, recv, par)
        if meta.shape[0]:
            # row index within the source's block -> within ``rows`` (sources' blocks in rank order)
            starts = torch.tensor(recv_rows, device=u.device).cumsum(0) - torch.tensor(recv_rows, device=u.device)
            src = torch.repeat_interleave(torch.arange(par.ep, device=u.device), torch.tensor(recv, device=u.device))
            x = rows.index_select(0, meta[:, 0].long() + starts.index_select(0, src))
            y = self.experts(x, x.new_ones(x.shape[0], 1, dtype=torch.float32), meta[:, 1:].long())
        else:
            y = rows.new_zeros(0, D, dtype=torch.float32)
        # expert outputs are u.dtype values (each backend casts its GEMM results back), so this cast is exact
        back = all_to_all(y.to(u.dtype), recv, send, par)
        row_bytes, me = D * u.element_size(), par.ep_rank
        self.traffic["dispatch_bytes"] += (sum(recv_rows) - recv_rows[me]) * row_bytes + (sum(recv) - recv[me]) * 8
        self.traffic["combine_bytes"] += (sum(send) - send[me]) * row_bytes
        self.traffic["tokens"] += n
        picked = torch.empty(n * k, D, dtype=torch.float32, device=u.device).index_copy_(0, order, back.float())
        picked.mul_(weights.reshape(-1, 1).float())
        return picked.view(n, k, D).sum(1)  # slots summed in order, as the single-process combine does

    @torch.no_grad()
    def rebalance(self, redundant: int) -> Placement:
        """Re-place the experts by the router statistics gathered since the last call (summed over the ep
        ranks) with ``redundant`` extra replicas for the hottest ones (``eplb.plan_placement``), and move the
        expert weights into their new slots with one all_to_all per expert tensor, each copied from the first
        rank that holds it now. Every ep rank must call this at the same point."""
        par, old = self.par, self.placement
        load = ep_all_reduce(self.expert_load.counts.clone(), par).tolist()
        new = plan_placement(load, par.ep, redundant)
        src = [reps[0] for reps in old.replicas]  # (rank, slot) each expert is copied from
        mine = new.experts_of_rank[par.ep_rank]
        send_slots = [[src[e][1] for e in new.experts_of_rank[r] if src[e][0] == par.ep_rank] for r in range(par.ep)]
        recv_into = [[j for j, e in enumerate(mine) if src[e][0] == s] for s in range(par.ep)]
        send, recv = [len(x) for x in send_slots], [len(x) for x in recv_into]
        for t in self.experts.expert_tensors():
            take = torch.tensor([i for x in send_slots for i in x], dtype=torch.long, device=t.device)
            into = torch.tensor([j for x in recv_into for j in x], dtype=torch.long, device=t.device)
            rows = all_to_all(t.index_select(0, take), send, recv, par)
            t.data = t.new_empty((len(mine), *t.shape[1:])).index_copy_(0, into, rows)
        self.experts.global_ids, self.experts.num_experts = mine, len(mine)
        self.placement = new
        self._tables.clear()
        self.expert_load.reset()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = split_counts(x.shape[0], self.par.tp)
        start = sum(counts[:self.par.tp_rank])
        mine = x[start:start + counts[self.par.tp_rank]]
        weights, ids = self.gate(mine)
        self.expert_load.add(ids)
        u = self.routed_expert_down_proj(mine) if self.latent else mine
        y = self.dispatch_combine(u, weights, ids).to(x.dtype)
        if self.latent and self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        self.traffic["gather_bytes"] += (x.shape[0] - y.shape[0]) * y.shape[1] * y.element_size()
        y = all_gather_rows(y, counts, self.par)
        if self.latent:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
