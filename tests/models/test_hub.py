"""Hugging Face repo ids as model names: resolved through ``huggingface_hub.snapshot_download`` (monkeypatched
here: tests have no network), served from a local HF cache under HF_HUB_OFFLINE=1, one clear line per failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import huggingface_hub
import pytest
from huggingface_hub import errors

from k3serve.cli import main
from k3serve.models.registry import resolve_model_path
from k3serve.testing import write_random_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_repo_id_is_fetched_with_the_serving_files(monkeypatch, tmp_path):
    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(tmp_path)

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    got = resolve_model_path("moonshotai/Kimi-Linear-48B-A3B-Instruct", revision="v1", download_dir=tmp_path / "c")
    assert got == tmp_path
    [(repo, kw)] = calls
    assert repo == "moonshotai/Kimi-Linear-48B-A3B-Instruct" and kw["revision"] == "v1"
    assert kw["cache_dir"] == str(tmp_path / "c")
    for pattern in ("*.json", "*.safetensors", "tiktoken.model", "*.py"):
        assert pattern in kw["allow_patterns"]


def test_local_directory_and_builtin_names_never_reach_the_hub(monkeypatch, tmp_path):
    def fake(*a, **kw):
        raise AssertionError("went to the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    (tmp_path / "owner" / "model").mkdir(parents=True)
    (tmp_path / "owner" / "model" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("owner/model") == Path("owner/model")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a built-in name"):
        resolve_model_path("no-such-model")  # not owner/name: a typo, not a repo


def _http(cls, msg):
    return cls(msg, response=httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/x")))


@pytest.mark.parametrize("exc,needle", [
    (lambda: _http(errors.RepositoryNotFoundError, "404 Client Error.\n\nRepository Not Found"),
     "not a local directory, a built-in name or a Hugging Face repo this machine can see"),
    (lambda: _http(errors.GatedRepoError, "401 Client Error.\n\nCannot access gated repo"),
     "is gated on the Hugging Face Hub: accept its terms at https://huggingface.co/owner/model"),
    (lambda: _http(errors.RevisionNotFoundError, "404 Client Error.\n\nRevision Not Found"),
     "has no revision 'v9' on the Hugging Face Hub"),
    (lambda: errors.LocalEntryNotFoundError("An error happened\nPlease check your internet connection"),
     "is not in the Hugging Face cache and cannot be fetched"),
    (lambda: _http(errors.HfHubHTTPError, "500 Server Error: boom\nmore"),
     "fetching it from the Hugging Face Hub failed: 500 Server Error: boom"),
])
def test_hub_failures_are_one_line(monkeypatch, capsys, exc, needle):
    def fake(*a, **kw):
        raise exc()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert main(["generate", "owner/model", "--revision", "v9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3serve: error: model 'owner/model'") and needle in err[0], err


def test_offline_generate_from_a_local_hf_cache(tmp_path):
    """The Hub cache layout (models--owner--name/refs/main -> snapshots/<commit>/) with HF_HUB_OFFLINE=1:
    the repo id resolves to the cached snapshot, with and without --revision, and without a network."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--owner--tiny"
    write_random_checkpoint("kimi-linear-tiny", repo / "snapshots" / commit, seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "k3serve", "generate", "--download-dir", str(tmp_path / "hub"),
            "--prompt-ids", "1,2", "--max-tokens", "2"]
    for extra in ([], ["--revision", commit]):
        r = subprocess.run([*base, "owner/tiny", *extra], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "generated ids: [" in r.stdout, r.stderr
    r = subprocess.run([*base, "owner/missing"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"k3serve: error: model 'owner/missing' is not in the Hugging Face cache {tmp_path / 'hub'} and cannot be "
        "fetched: HF_HUB_OFFLINE is set")
