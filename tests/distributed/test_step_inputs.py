"""The step message survives its trip as tensors (what a worker rank unpacks is what rank 0 packed), and
inconsistent step inputs are refused where they are built."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.step_inputs import STEP, StepInputs, embeds_shape, pack, payload_len, unpack


def test_pack_unpack_round_trip_with_copies_spans_and_images():
    s = StepInputs(input_ids=[5, 6, 7, 8, 9], cu_seqlens=[0, 4, 5], cached_lens=[0, 17], slots=[3, 0],
                   block_tables=[4, -1, 7, 2], width=2, copies_before=[(9, 3)], copies_after=[(3, 10), (0, 11)],
                   logit_rows=[3, 4], prompt_spans=[(0, 3)], image_embeds=torch.randn(2, 6, dtype=torch.bfloat16))
    h, payload = pack(s)
    assert int(h[0]) == STEP and payload_len(h) == payload.numel()
    (rows, dim), dtype = embeds_shape(h)
    back = unpack(h, payload, s.image_embeds.clone())
    assert (rows, dim, dtype) == (2, 6, torch.bfloat16)
    for f in ("input_ids", "cu_seqlens", "cached_lens", "slots", "block_tables", "width", "copies_before",
              "copies_after", "logit_rows", "prompt_spans"):
        assert getattr(back, f) == getattr(s, f), f
    assert torch.equal(back.image_embeds, s.image_embeds)


def test_no_images_no_embeds():
    h, payload = pack(StepInputs([1], [0, 1], [0], [0], [0], 1))
    assert embeds_shape(h) is None and unpack(h, payload).image_embeds is None


@pytest.mark.parametrize("bad", [dict(cu_seqlens=[0, 1, 2]), dict(block_tables=[0, 1]), dict(input_ids=[1, 2])])
def test_inconsistent_inputs_are_refused(bad):
    fields = dict(input_ids=[1], cu_seqlens=[0, 1], cached_lens=[0], slots=[0], block_tables=[0], width=1)
    with pytest.raises(ValueError):
        StepInputs(**{**fields, **bad})
