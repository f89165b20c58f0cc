"""The checkpoint loader: built-in names, sharding, aliases, F32 tensors, and one clear error per bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3serve.core.config import ConfigError, ModelConfig
from k3serve.layers.weights import CheckpointError
from k3serve.models.generate import SimpleRunner
from k3serve.models.loader import load_model
from k3serve.models.registry import packaged_config, resolve_model_path
from k3serve.testing import write_random_checkpoint


@pytest.fixture(scope="module")
def k3_ckpt(tmp_path_factory):
    return write_random_checkpoint("k3-tiny", tmp_path_factory.mktemp("k3"), seed=3)


def _logits(model, ids=(1, 2, 3, 4, 5)):
    return SimpleRunner(model, max_seqs=1, max_len=8).step({0: list(ids)})


def test_builtin_name_resolves_deterministically(tmp_path, monkeypatch):
    monkeypatch.setenv("K3SERVE_CACHE", str(tmp_path))
    p = resolve_model_path("kimi-linear-tiny-random")
    first = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").unlink()
    (p / "config.json").unlink()
    assert (resolve_model_path("kimi-linear-tiny-random") / "model.safetensors").read_bytes() == first


def test_k3_layout_dtypes_and_keys(k3_ckpt):
    with safe_open(k3_ckpt / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        p = "language_model.model.layers."
        assert f.get_slice(p + "0.self_attn.A_log").get_dtype() == "F32"
        assert f.get_slice(p + "0.self_attn.A_log").get_shape() == [32]  # [head_dim], first num_heads live
        assert f.get_slice(p + "0.self_attn.q_conv1d.weight").get_dtype() == "F32"
        assert f.get_slice(p + "0.self_attn.q_proj.weight").get_dtype() == "BF16"
        assert f.get_slice(p + "1.block_sparse_moe.experts.5.w1.weight_packed").get_dtype() == "U8"
        assert f.get_slice(p + "1.block_sparse_moe.experts.5.w2.weight_scale").get_shape() == [64, 2]
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in keys
    assert "language_model.model.output_attn_res_proj.weight" in keys
    assert "language_model.model.layers.3.self_attn.g_proj.weight" in keys  # MLA output gate
    assert any(k.startswith("vision_tower.") for k in keys) and any(k.startswith("mm_projector.") for k in keys)


def test_bf16_model_keeps_f32_tensors(k3_ckpt):
    model, _ = load_model(k3_ckpt, dtype=torch.bfloat16, progress=False)
    attn = model.language_model.model.layers[0].self_attn
    assert attn.A_log.dtype == torch.float32 and attn.q_conv1d.weight.dtype == torch.float32
    assert attn.q_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(_logits(model)).all()


def test_sharded_checkpoint_with_index_loads_identically(tmp_path, k3_ckpt):
    sharded = write_random_checkpoint("k3-tiny", tmp_path, seed=3, max_shard_bytes=200_000)
    assert (sharded / "model.safetensors.index.json").exists()
    a, _ = load_model(k3_ckpt, progress=False)
    b, _ = load_model(sharded, progress=False)
    torch.testing.assert_close(_logits(a), _logits(b), rtol=0, atol=0)


def _rewrite(src, dst, edit):
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("language_model.model.layers.2.self_attn.b_proj.weight"), "missing tensor 'language_model.model.layers.2.self_attn.b_proj.weight'"),
    (lambda t: t.__setitem__("language_model.model.layers.2.extra.weight", torch.zeros(2)), "unexpected tensor 'language_model.model.layers.2.extra.weight'"),
    (lambda t: t.__setitem__("language_model.lm_head.weight", torch.zeros(3, 3)), "tensor 'language_model.lm_head.weight' has shape"),
])
def test_bad_tensors_name_the_tensor(tmp_path, k3_ckpt, edit, match):
    bad = _rewrite(k3_ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(bad, progress=False)


@pytest.mark.parametrize("shape", [(4,), (32,), (1, 1, 4, 1)])
def test_a_log_accepts_published_shapes(tmp_path, k3_ckpt, shape):
    key = "language_model.model.layers.0.self_attn.A_log"
    ref, _ = load_model(k3_ckpt, progress=False)
    want = ref.language_model.model.layers[0].self_attn.A_log.detach().clone()

    def edit(t):
        full = torch.zeros(32)
        full[:4] = want
        t[key] = full[: shape[0]] if len(shape) == 1 else want.reshape(shape)
    model, _ = load_model(_rewrite(k3_ckpt, tmp_path / "a", edit), progress=False)
    torch.testing.assert_close(model.language_model.model.layers[0].self_attn.A_log, want)


def test_language_model_layers_prefix_alias(tmp_path, k3_ckpt):
    def edit(t):
        for k in [k for k in t if k.startswith("language_model.model.layers.")]:
            t[k.replace("language_model.model.layers.", "language_model.layers.")] = t.pop(k)
    model, _ = load_model(_rewrite(k3_ckpt, tmp_path / "alias", edit), progress=False)
    ref, _ = load_model(k3_ckpt, progress=False)
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=0, atol=0)


def _config(**text_changes):
    d = json.loads(packaged_config("k3-tiny").read_text())
    d["text_config"].update(text_changes)
    return d


@pytest.mark.parametrize("d,match", [
    ({**_config(), "model_type": "llama"}, "model_type"),
    (_config(num_experts_per_token=100), "num_experts_per_token"),
    (_config(linear_attn_config={**_config()["text_config"]["linear_attn_config"], "kda_layers": [1, 2, 3, 4]}),
     "layer 4 listed twice"),
    (_config(linear_attn_config={**_config()["text_config"]["linear_attn_config"], "kda_layers": [1, 2]}),
     "neither kda nor full attention"),
    (_config(num_expert_group=3), "num_expert_group"),
    (_config(hidden_act="gelu"), "hidden_act"),
    ({k: v for k, v in _config().items() if k != "text_config"}, "text_config"),
])
def test_bad_configs_name_the_field(d, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(d)


def test_pickle_only_and_missing_dirs(tmp_path):
    (tmp_path / "config.json").write_text(packaged_config("kimi-linear-tiny").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_model(tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="neither a directory nor a built-in name"):
        load_model(tmp_path / "nope", progress=False)


def test_tied_embeddings_are_stored_once(tmp_path):
    d = json.loads(packaged_config("kimi-linear-tiny").read_text())
    d["tie_word_embeddings"] = True
    path = write_random_checkpoint(d, tmp_path, seed=1)
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model, _ = load_model(path, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.isfinite(_logits(model)).all()
