"""Resolve ``--model``: a packaged config name (``kimi-k3``, ``kimi-linear-48b``, ...), a config.json, or a
checkpoint directory holding one."""

from __future__ import annotations

from pathlib import Path

from k3serve.core.config import ModelConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "models" / "configs"
_HUB_NAMES = {"moonshotai/kimi-k3": "kimi-k3", "moonshotai/kimi-linear-48b-a3b-instruct": "kimi-linear-48b"}


def packaged_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_model_config(spec: str) -> tuple[str, ModelConfig]:
    """``(display name, config)``; a ValueError/FileNotFoundError with one clear line otherwise."""
    name = _HUB_NAMES.get(spec.lower(), spec.lower())
    packaged = CONFIG_DIR / f"{name}.json"
    if packaged.is_file():
        return name, ModelConfig.from_file(packaged)
    path = Path(spec).expanduser()
    if path.exists():
        return str(path), ModelConfig.from_file(path)
    raise ValueError(f"unknown model {spec!r}: not a packaged config ({', '.join(packaged_names())}) "
                     "nor an existing config.json or checkpoint directory")
