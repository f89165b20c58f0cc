"""The eagle3 drafter and ``k3serve spec train``: a tiny end-to-end training on k3-tiny-random (collect,
train, save), the save/load round trip, a rerun resuming from the per-epoch checkpoint, greedy outputs with
the head on equal those with speculation off (both tiny models, mixed batches, k = 0..8), and one-line
errors for a head that does not fit the target."""

from __future__ import annotations

import json

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.train import TrainOptions, train_head
from k3serve.models.eagle import EagleHead

MAX_NEW = 12


def _prompts(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2000, (int(k),), generator=g).tolist() for k in torch.randint(3, 30, (n,), generator=g)]


PROMPTS = _prompts(3, 5)


def _train(eh, name, out, epochs, log=print):
    model, config = eh.get_model(name)
    engine = eh.make_engine((model, config), max_num_seqs=8)
    opts = TrainOptions(max_tokens=MAX_NEW, epochs=epochs, depth=2, batch_size=16, draft_vocab_size=512, lr=5e-3)
    return train_head(model, engine, PROMPTS, out, opts, progress=False, log=log)


@pytest.fixture(scope="module")
def heads(eh, tmp_path_factory):
    """A head per tiny model, trained on that model's answers to PROMPTS."""
    out = {}
    for name in ("k3-tiny-random", "kimi-linear-tiny-random"):
        d = tmp_path_factory.mktemp(name)
        _train(eh, name, d, epochs=6)
        out[name] = d
    return out


def test_save_load_round_trip(heads):
    path = heads["k3-tiny-random"]
    head = EagleHead.load(path)
    again = EagleHead.load(path)
    assert json.loads((path / "config.json").read_text())["architecture"] == "eagle3"
    emb, f = torch.randn(2, head.cfg.hidden_size), torch.randn(2, 3 * head.cfg.hidden_size)
    assert torch.equal(head.step(emb, f)[0], again.step(emb, f)[0])
    assert torch.equal(head.d2t, again.d2t) and head.cfg.draft_vocab_size <= 512


def test_rerun_resumes_from_the_checkpoint(eh, tmp_path):
    lines = []
    _train(eh, "k3-tiny-random", tmp_path, epochs=1, log=lines.append)
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"epochs_done": 1}
    first = EagleHead.load(tmp_path).state_dict()
    _train(eh, "k3-tiny-random", tmp_path, epochs=2, log=lines.append)
    assert any("reusing" in x for x in lines) and any("resuming after epoch 1 of 2" in x for x in lines)
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"epochs_done": 2}
    assert any(not torch.equal(v, EagleHead.load(tmp_path).state_dict()[k]) for k, v in first.items())


def _run(eh, name, spec, **cfg):
    engine = eh.make_engine(eh.get_model(name), speculative_config=spec, **cfg)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for i in (0, 1):
        engine.add_request(str(i), PROMPTS[i], params)
    done = {}
    for _ in range(3):  # the others join while these decode: prefill chunks beside verify rows
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    for i in range(2, len(PROMPTS)):
        engine.add_request(str(i), PROMPTS[i], params)
    engine.add_request("gone", PROMPTS[0] + [5, 6], params)  # a prefix hit on request 0, then aborted
    done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.abort_request("gone").finish_reason == "abort"
    done.update(eh.drain(engine))
    return [done[str(i)].token_ids for i in range(len(PROMPTS))], engine


@pytest.mark.parametrize("name", ["k3-tiny-random", "kimi-linear-tiny-random"])
@pytest.mark.parametrize("k", [0, 2, 8])
def test_greedy_equal_with_the_head(eh, heads, name, k):
    ref, _ = _run(eh, name, None, max_num_batched_tokens=24)
    got, engine = _run(eh, name, SpeculativeConfig(method="eagle3", model=str(heads[name]),
                                                   num_speculative_tokens=k), max_num_batched_tokens=24)
    assert got == ref
    s = engine.scheduler
    assert s.num_spec_rows > 0 and (s.num_draft_tokens > 0) == (k > 0)
    if k > 0:  # trained on these very answers: most first drafts are right
        assert s.num_accepted_tokens > 0.3 * s.num_spec_rows


def test_a_head_for_another_model_is_one_error(eh, heads):
    model, config = eh.get_model("k3-tiny-fullvocab-random")
    spec = SpeculativeConfig(method="eagle3", model=str(heads["k3-tiny-random"]))
    with pytest.raises(ValueError, match="^speculative_config: eagle3 head .* has a vocabulary of 2048 tokens, "
                                         "the target 163840$"):
        LLMEngine(model, model_config=config, config=EngineConfig(kv_cache_memory=2**24, max_model_len=64,
                                                                  speculative_config=spec))
    with pytest.raises(ValueError, match="no readable config.json"):
        EagleHead.load(heads["k3-tiny-random"] / "nowhere")
