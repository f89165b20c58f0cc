"""Where each KDA state slot lives in the cache tensors, arranged so that a batch's slots are the leading rows.

The scheduler's slots (``StatePool``) are logical; ``kda_state[layer]`` / ``kda_conv[layer]`` rows are physical.
Before each forward, ``arrange(slots)`` moves states so that batch row i's slot sits at row i (swapping out
whatever was there, running state or snapshot alike, in every KDA cache tensor at once). The KDA layers then
update ``cache[:B]`` in place instead of gathering ``B`` states into a copy and scattering them back, per layer
and step. The batch order is the running list's (FCFS, stable between steps), so states move only when the
batch's membership changes (a request finishes, joins or is preempted).
"""

from __future__ import annotations

import torch


class StateRows:
    def __init__(self, num_slots: int, tensors: list[torch.Tensor]):
        self.tensors = tensors  # every KDA cache tensor, [num_slots, ...] each
        self.row_of = list(range(num_slots))  # slot -> row
        self.slot_at = list(range(num_slots))  # row -> slot

    def rows(self, slots: list[int]) -> list[int]:
        """The cache rows holding ``slots`` now (slots themselves when there are no KDA tensors)."""
        return [self.row_of[s] for s in slots] if self.tensors else list(slots)

    def arrange(self, slots: list[int]) -> None:
        """Put ``slots[i]`` at row ``i`` for every i, moving the states with them."""
        if not self.tensors:
            return
        before = {}
        for i, s in enumerate(slots):
            r = self.row_of[s]
            if r == i:
                continue
            other = self.slot_at[i]  # not one of slots[:i]: those already sit at rows < i
            for slot in (s, other):
                before.setdefault(slot, self.row_of[slot])
            self.row_of[s], self.row_of[other] = i, r
            self.slot_at[i], self.slot_at[r] = s, other
        moved = [s for s, r in before.items() if self.row_of[s] != r]
        if not moved:
            return
        device = self.tensors[0].device
        src = torch.tensor([before[s] for s in moved], device=device)
        dst = torch.tensor([self.row_of[s] for s in moved], device=device)
        for t in self.tensors:
            t.index_copy_(0, dst, t.index_select(0, src))  # a permutation of the moved rows: read all, then write
