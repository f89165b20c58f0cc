"""The Kimi text model (K3 and Kimi-Linear share it) and the K3 multimodal wrapper.

``KimiForCausalLM``: ``model.{embed_tokens, layers.*, norm, output_attn_res_*}`` + ``lm_head``; checkpoint keys
carry no prefix for Kimi-Linear and ``language_model.`` for K3 (``KimiK3ForConditionalGeneration``, which adds
``vision_tower.*`` and ``mm_projector.*``).

Forward over a packed batch: input_ids ``[N]`` -> hidden ``[N, d]`` (inside the active ``ForwardContext``);
``compute_logits(hidden [n, d]) -> [n, vocab]`` in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.core.config import ModelConfig, TextConfig
from k3serve.core.context import ForwardContext
from k3serve.core.distributed import SINGLE, Parallel
from k3serve.layers.attn_res import AttnResState, AttnResWeights
from k3serve.layers.decoder import DecoderLayer
from k3serve.layers.moe import RoutedExperts
from k3serve.layers.norm import KimiRMSNorm
from k3serve.layers.parallel_linear import ColumnParallelLinear, VocabParallelEmbedding
from k3serve.ops import registry


class KimiModel(nn.Module):
    def __init__(self, cfg: TextConfig, *, model_type: str, mxfp4_experts: bool, par: Parallel = SINGLE):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, d, par)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, model_type=model_type, mxfp4_experts=mxfp4_experts, par=par)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = KimiRMSNorm(d, cfg.rms_norm_eps)
        self.attn_res = cfg.attn_res_block_size is not None
        if self.attn_res:
            self.output_attn_res_proj = nn.Linear(d, 1, bias=False)
            self.output_attn_res_norm = AttnResWeights(d)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        keep = ctx.capture
        if not self.attn_res:
            for i, layer in enumerate(self.layers):
                h = layer(h, ctx)
                if keep is not None and i in keep:
                    keep[i] = h
            return self.norm(h)
        state = AttnResState(h)
        for i, layer in enumerate(self.layers):
            layer.forward_attn_res(state, ctx)
            if keep is not None and i in keep:  # the plain residual stream: every block sum and the partial
                keep[i] = sum(state.blocks, state.partial)
        h = registry.get("attn_res_mix")(state.blocks, state.partial, self.output_attn_res_proj.weight,
                                         self.output_attn_res_norm.weight, self.cfg.rms_norm_eps)
        return self.norm(h)


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: TextConfig, *, model_type: str = "kimi_linear", mxfp4_experts: bool = False,
                 par: Parallel = SINGLE):
        super().__init__()
        self.model = KimiModel(cfg, model_type=model_type, mxfp4_experts=mxfp4_experts, par=par)
        # vocab-parallel: each rank's logits for its vocabulary slice, gathered along the last dim
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, par, gather=True)
        self.tied = cfg.tie_word_embeddings
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them (again after ``to_empty``)."""
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied_to = "embed_tokens"  # loaded (and written) through the embedding only

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, ctx, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class KimiK3ForConditionalGeneration(nn.Module):
    def __init__(self, config: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        self.language_model = KimiForCausalLM(config.text, model_type=config.model_type,
                                              mxfp4_experts=config.experts_mxfp4, par=par)
        self.placeholder_id = config.media_placeholder_token_id
        if config.vision is not None:
            from k3serve.layers.vision import MoonViT, PatchMergerProjector

            self.vision_tower = MoonViT(config.vision)
            self.mm_projector = PatchMergerProjector(config.vision)

    def embed_images(self, pixel_patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Image embeddings ``[n_media_tokens, d]`` for patches ``[P, 3, 14, 14]`` with grids ``[n_images, 3]``."""
        if not hasattr(self, "vision_tower"):
            raise ValueError("this model has no vision tower")
        return self.mm_projector(self.vision_tower(pixel_patches, grid_thw))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        embed = self.language_model.model.embed_tokens
        if image_embeds is None:
            return self.language_model(input_ids, ctx)
        is_media = input_ids == self.placeholder_id
        if int(is_media.sum()) != image_embeds.shape[0]:
            raise ValueError(f"{int(is_media.sum())} media placeholder tokens but {image_embeds.shape[0]} "
                             "image embeddings")
        h = embed(input_ids.masked_fill(is_media, 0))
        h = h.masked_scatter(is_media[:, None], image_embeds.to(h.dtype))
        return self.language_model(input_ids, ctx, inputs_embeds=h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)


def check_layout(config: ModelConfig, par: Parallel) -> None:
    """One clear ValueError when ``par``'s layout cannot split this model (before anything is built or read)."""
    t = config.text
    counts = dict(heads=t.num_attention_heads, kda_heads=t.linear_attn.num_heads, vocab=t.vocab_size,
                  intermediate_size=t.intermediate_size)
    if t.num_experts:  # experts split by width over tp (ep 1) or whole over the ep ranks
        counts.update(experts=t.num_experts) if par.ep > 1 else counts.update(moe_intermediate=t.moe_intermediate_size)
    par.layout.check(**counts)


def build_model(config: ModelConfig, par: Parallel = SINGLE) -> nn.Module:
    """The module tree for ``config``, holding this rank's shard under ``par`` (parameters uninitialised
    unless the caller initialises them). The layout is checked first."""
    check_layout(config, par)
    if config.model_type == "kimi_k3":
        return KimiK3ForConditionalGeneration(config, par)
    return KimiForCausalLM(config.text, model_type=config.model_type, mxfp4_experts=config.experts_mxfp4, par=par)


def text_model(model: nn.Module) -> KimiForCausalLM:
    return model.language_model if isinstance(model, KimiK3ForConditionalGeneration) else model


def set_expert_act_quant(model: nn.Module, mode: str | None) -> None:
    """Switch MXFP8 fake-quant of routed-expert GEMM inputs on (``"rceil"``/``"floor"``) or off (``None``)."""
    if mode not in (None, "rceil", "floor"):
        raise ValueError(f"act_quant must be None, 'rceil' or 'floor', got {mode!r}")
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.act_quant = mode
