"""Model names: checkpoint directories, built-in names that resolve without a download, and Hugging Face
repo ids (fetched by ``hub``).

``<name>-random`` names are random checkpoints of the packaged tiny configs, written deterministically (seed 0)
on first use into the cache directory (``$K3SERVE_CACHE``, else ``$XDG_CACHE_HOME/k3serve``, else
``~/.cache/k3serve``), so every command works offline before any real weights exist.
``TRAINED_MODELS`` are checkpoints shipped inside the package (``k3serve/models/weights/<name>``), e.g. the
default model ``k3-default`` trained by the repository's ``training/`` (see ``training/README.md``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
RANDOM_MODELS = {
    "k3-tiny-random": "k3-tiny.json",
    "k3-tiny-grouped-random": "k3-tiny-grouped.json",
    "kimi-linear-tiny-random": "kimi-linear-tiny.json",
    # k3-tiny with the full Kimi vocabulary, so real chat prompts (special ids >= 163584) fit
    "k3-tiny-fullvocab-random": "k3-tiny-fullvocab.json",
}
WEIGHTS_DIR = Path(__file__).parent / "weights"
# whatever trained checkpoints this copy of the package ships (a directory with config + safetensors each)
TRAINED_MODELS = tuple(sorted(p.parent.name for p in WEIGHTS_DIR.glob("*/model.safetensors")))
PACKAGED_CONFIGS = {"kimi-k3": "kimi-k3.json", "kimi-linear-48b": "kimi-linear-48b.json"}


def cache_dir() -> Path:
    if os.environ.get("K3SERVE_CACHE"):
        return Path(os.environ["K3SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k3serve"


def packaged_config(name: str) -> Path:
    """Path of a packaged config json by short name (``kimi-k3``, ``k3-tiny``...)."""
    fname = PACKAGED_CONFIGS.get(name) or RANDOM_MODELS.get(name) or f"{name}.json"
    path = CONFIG_DIR / fname
    if not path.exists():
        known = sorted([*PACKAGED_CONFIGS, *(p.stem for p in CONFIG_DIR.glob("*.json"))])
        raise FileNotFoundError(f"unknown model config {name!r}; packaged: {', '.join(sorted(set(known)))}")
    return path


def resolve_model_path(name_or_path: str | Path, *, revision: str | None = None,
                       download_dir: str | Path | None = None) -> Path:
    """A checkpoint directory for a path, a built-in model name (creating random ones on first use) or a
    Hugging Face repo id ``owner/name`` (downloaded at ``revision`` into ``download_dir``, see ``hub``)."""
    name = str(name_or_path)
    if name in TRAINED_MODELS:
        return WEIGHTS_DIR / name
    if name in RANDOM_MODELS:
        target = cache_dir() / name
        if not (target / "config.json").exists():
            from k3serve.models.writer import write_random_checkpoint
            from k3serve.core.config import ModelConfig

            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
            write_random_checkpoint(ModelConfig.from_file(CONFIG_DIR / RANDOM_MODELS[name]), tmp, seed=0)
            try:
                tmp.rename(target)
            except OSError:  # another process won the race; theirs is identical
                shutil.rmtree(tmp, ignore_errors=True)
        return target
    path = Path(name).expanduser()
    if not path.exists() and isinstance(name_or_path, str):
        from k3serve.models import hub

        if hub.is_repo_id(name):
            path = hub.download(name, revision, download_dir)
    if not path.exists():
        raise FileNotFoundError(f"model {name!r} is neither a directory nor a built-in name "
                                f"({', '.join([*TRAINED_MODELS, *RANDOM_MODELS])}) nor a Hugging Face repo id "
                                "(owner/name)")
    if path.is_file():
        raise FileNotFoundError(f"model path {name!r} is a file; pass the checkpoint directory")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}")
    return path
