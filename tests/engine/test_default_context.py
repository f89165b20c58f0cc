"""Issue 48 item 3: a checkpoint declaring a 1M-token context starts with default options, in ``LLM(path)`` and in
``k3serve serve path``: the default context is capped to what the cache budget holds (one log line says so), and
an explicit ``max_model_len`` that does not fit stays a clear error."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import httpx
import pytest

from k3serve.engine.llm import LLM
from k3serve.engine.memory import fitting_model_len, plan_cache
from k3serve.engine.sampling_params import SamplingParams
from k3serve.testing import write_random_checkpoint

ONE_M = 1_048_576


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    """kimi-linear-tiny with its config rewritten to declare 1M positions (HF `model_max_length` alias too)."""
    path = write_random_checkpoint("kimi-linear-tiny", tmp_path_factory.mktemp("ctx1m"), seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = ONE_M
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": ONE_M}))
    return path


def test_fitting_model_len_is_what_plan_cache_accepts():
    sizes = dict(mla_bytes_per_token=960, kda_bytes_per_slot=40_000, block_size=16, max_running=8,
                 snapshot_fraction=0.25)
    budget = 64 << 20
    fits = fitting_model_len(budget, declared=ONE_M, **sizes)
    assert 0 < fits < ONE_M and fits % 16 == 0
    plan = plan_cache(budget, max_model_len=fits, **sizes)  # the cap fits...
    assert plan.num_blocks * 16 >= fits
    with pytest.raises(ValueError, match="too small"):  # ...and one block more does not
        plan_cache(budget, max_model_len=fits + 16, **sizes)
    assert fitting_model_len(budget, declared=4096, **sizes) == 4096  # a short model is never raised


def test_llm_starts_on_a_1m_checkpoint_with_defaults(long_ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="k3serve.engine"):
        llm = LLM(str(long_ckpt), tokenizer=None, max_num_seqs=4)
    cap = llm.engine.max_model_len
    assert 0 < cap < ONE_M
    lines = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(lines) == 1 and str(cap) in lines[0] and str(ONE_M) in lines[0]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    # a bigger budget gives a longer default context
    assert LLM(str(long_ckpt), tokenizer=None, max_num_seqs=4, kv_cache_memory=512 << 20).engine.max_model_len > cap


def test_explicit_max_model_len_that_does_not_fit_is_a_clear_error(long_ckpt):
    with pytest.raises(ValueError, match=r"kv_cache_memory: .* too small.*1048576-token sequence"):
        LLM(str(long_ckpt), tokenizer=None, max_num_seqs=4, max_model_len=ONE_M)


@pytest.mark.parametrize("flags", [[], ["--kv-cache-memory", "64MiB"]])
def test_serve_starts_on_a_1m_checkpoint_with_defaults(long_ckpt, flags):
    from tests.server.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3serve", "serve", str(long_ckpt), "--port", str(port),
                             "--max-num-seqs", "4", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen: list[str] = []
    try:
        url = f"http://127.0.0.1:{port}"
        for line in proc.stdout:  # the engine's cap warning comes first, then "k3serve: serving ... on URL"
            seen.append(line)
            if line.startswith("k3serve: "):
                break
        for _ in range(100):  # the port is bound before uvicorn listens on it
            try:
                models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
                break
            except httpx.ConnectError:
                time.sleep(0.2)
        assert 0 < models[0]["max_model_len"] < ONE_M
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert any("max_model_len" in line for line in seen), seen


def test_serve_refuses_a_bad_kv_cache_memory():
    r = subprocess.run([sys.executable, "-m", "k3serve", "serve", "--kv-cache-memory", "lots"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a byte size" in r.stderr and "Traceback" not in r.stderr
