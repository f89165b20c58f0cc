"""Helpers for tests and benchmarks: random checkpoints in the exact HF layout.

    from k3serve.testing import write_random_checkpoint
    write_random_checkpoint("k3-tiny", tmp_path, seed=0)              # a packaged config by name
    write_random_checkpoint(ModelConfig.from_file(p), tmp_path, seed=1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from k3serve.core.config import ModelConfig
from k3serve.models.registry import packaged_config
from k3serve.models.writer import write_random_checkpoint as _write


def write_random_checkpoint(config: ModelConfig | str | dict[str, Any], path: str | Path, seed: int = 0, *,
                            dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 30) -> Path:
    if isinstance(config, str):
        config = ModelConfig.from_file(packaged_config(config))
    elif isinstance(config, dict):
        config = ModelConfig.from_dict(config)
    return _write(config, path, seed, dtype=dtype, max_shard_bytes=max_shard_bytes)
