"""Checkpoints named by a Hugging Face repo id (``moonshotai/Kimi-Linear-48B-A3B-Instruct``): downloaded
with ``huggingface_hub.snapshot_download`` into its cache (``--download-dir``, else ``$HF_HUB_CACHE`` /
``$HF_HOME``), only the files serving needs, with its progress bars. ``HF_HUB_OFFLINE=1`` serves from the
cache without any network; ``HF_TOKEN`` (or ``hf auth login``) opens gated repos. Every failure is one
line: an ``OSError`` the CLI prints as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

# config, weights (+ index), tokenizer, remote code and chat template; not READMEs, images or .pth copies
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "tiktoken.model", "*.tiktoken", "*.model", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_repo_id(name: str) -> bool:
    """``owner/name`` with Hub-legal characters (a path that exists locally is taken as a path first)."""
    return _REPO_ID.fullmatch(name) is not None and ".." not in name


def download(repo_id: str, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (default: main), fetching what is missing."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise OSError(f"model {repo_id!r} looks like a Hugging Face repo id, and fetching it needs "
                                  "huggingface_hub: pip install huggingface_hub") from None
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                                 cache_dir=None if download_dir is None else str(download_dir))
    except errors.GatedRepoError:
        raise PermissionError(f"model {where} is gated on the Hugging Face Hub: accept its terms at "
                              f"https://huggingface.co/{repo_id} and log in (hf auth login, or set HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r} is not a local directory, a built-in name or a Hugging Face "
                                "repo this machine can see (for a private repo, log in or set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except errors.LocalEntryNotFoundError:
        raise FileNotFoundError(f"model {where} is not in the Hugging Face cache"
                                f"{f' {download_dir}' if download_dir is not None else ''} and cannot be fetched: "
                                + ("HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE
                                   else "the Hub is unreachable from this machine")) from None
    except errors.HfHubHTTPError as e:
        raise ConnectionError(f"model {where}: fetching it from the Hugging Face Hub failed: "
                              f"{str(e).splitlines()[0]}") from None
    except OSError as e:  # disk full, permissions on the cache
        raise OSError(f"model {where}: fetching it failed: {e}") from None
    return Path(path)
