"""K3 wiring of the vision tower: image embeddings replace exactly the media placeholder positions."""

from __future__ import annotations

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.models.generate import SimpleRunner
from k3serve.models.kimi import build_model
from k3serve.models.registry import packaged_config
from k3serve.models.writer import init_random_


@pytest.fixture(scope="module")
def k3():
    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))
    return cfg, init_random_(build_model(cfg), seed=4).eval()


def test_image_embeddings_fill_placeholders(k3):
    cfg, model = k3
    pad = cfg.media_placeholder_token_id
    patches = torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 2x2 merge -> 4 media tokens
    with torch.inference_mode():
        emb = model.embed_images(patches, grid)
    assert emb.shape == (4, cfg.text.hidden_size)
    ids = [5, 6, pad, pad, pad, pad, 7, 8]
    with_image = SimpleRunner(model, max_seqs=1, max_len=8).step({0: ids}, image_embeds=emb)
    other = SimpleRunner(model, max_seqs=1, max_len=8).step({0: ids}, image_embeds=emb * 2)
    assert not torch.allclose(with_image, other)
    with pytest.raises(ValueError, match="4 media placeholder tokens but 3 image embeddings"):
        SimpleRunner(model, max_seqs=1, max_len=8).step({0: ids}, image_embeds=emb[:3])


class _ManualScatter(torch.nn.Module):
    """Restatement: embed the text, overwrite the placeholder rows one by one, run the text model."""

    def __init__(self, model, pad):
        super().__init__()
        self.model, self.pad = model, pad

    def forward(self, input_ids, ctx, image_embeds):
        lm = self.model.language_model
        h = lm.model.embed_tokens(input_ids.clamp(max=lm.model.embed_tokens.num_embeddings - 1)).clone()
        rows = [i for i, t in enumerate(input_ids.tolist()) if t == self.pad]
        for j, i in enumerate(rows):
            h[i] = image_embeds[j]
        return lm(input_ids, ctx, inputs_embeds=h)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def test_scatter_matches_manual_restatement(k3):
    cfg, model = k3
    pad = cfg.media_placeholder_token_id
    with torch.inference_mode():
        emb = model.embed_images(torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(1)),
                                 torch.tensor([[1, 4, 4]]))
    ids = [5, pad, pad, 6, pad, pad, 9]
    got = SimpleRunner(model, max_seqs=1, max_len=8).step({0: ids}, image_embeds=emb)
    want = SimpleRunner(_ManualScatter(model, pad), max_seqs=1, max_len=8).step({0: ids}, image_embeds=emb)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
