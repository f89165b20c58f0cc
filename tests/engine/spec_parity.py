"""The mixed batch the speculative parity tests run (``test_spec_parity_default``, ``test_spec_parity_grid``),
with speculation off and on, to compare greedy outputs.

``scenario``: requests 0 and 1 start alone and decode a few steps; then request 2, request 3 (request 0's
prompt + a tail: a prefix hit) and "gone" (aborted after one step) join, so prefill chunks (small
``max_num_batched_tokens``) run beside verify rows; optionally a json_schema request joins too (its grammar is
checked against every draft). ``preempting``: an engine config whose cache holds a few requests only, so the
scheduler preempts and recomputes. Drafters: the four methods, with a random eagle3 head when no trained one
is given (its drafts are almost all rejected: the rollback of every position is exercised).
"""

from __future__ import annotations

import json

import torch

from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.rollback import SlotsRollback
from k3serve.models.eagle import EagleConfig, EagleHead, default_feature_layers

METHODS = ("ngram", "suffix", "draft_model", "eagle3")
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["c", "ok"], "additionalProperties": False}


class NoRestore(SlotsRollback):
    """Deliberately wrong: keeps the state after every draft, accepted or not."""

    def _commit(self, num_accepted, snapshots):
        self._slots.clear()


def random_head(model, out, seed: int = 0) -> str:
    """A random eagle3 head for ``model`` (``(module, config)``) saved in ``out``."""
    text = model[1].text
    torch.manual_seed(seed)
    cfg = EagleConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                      feature_layers=default_feature_layers(text.num_hidden_layers),
                      draft_vocab_size=min(text.vocab_size, 512), intermediate_size=2 * text.hidden_size)
    EagleHead(cfg).save(out)
    return str(out)


def spec(method: str, k: int, draft: str | None = None, head: str | None = None, **kw) -> SpeculativeConfig:
    model = draft if method == "draft_model" else head if method == "eagle3" else None
    return SpeculativeConfig(method=method, model=model, num_speculative_tokens=k, **kw)


def preempting(model, prompts, max_new: int, k: int = 8) -> dict:
    """Engine options whose cache fits the longest request (and its drafts) and one block more."""
    from k3serve.models.cache import cache_spec

    cs = cache_spec(model[0], torch.float32)
    longest = max(len(p) for p in prompts) + 8 + max_new + k + 1
    blocks = (longest + 15) // 16 + 1
    return {"max_num_seqs": 5, "enable_prefix_caching": False, "max_model_len": longest,
            "kv_cache_memory": 6 * cs.kda_bytes_per_slot + blocks * 16 * cs.mla_bytes_per_token}


def scenario(eh, model, prompts, max_new: int, spec_config: SpeculativeConfig | None = None, *,
             guided_prompt: list[int] | None = None, rollback=None, **cfg):
    """Outputs ``{request id: token ids}`` of the mixed batch (``prompts``: at least 3) and the engine."""
    engine = eh.make_engine(model, speculative_config=spec_config, **cfg)
    if rollback is not None:
        engine.runner.rollback = rollback
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    done, gd = {}, None

    def step():
        done.update((o.request_id, o) for o in engine.step() if o.finished)

    engine.add_request("0", prompts[0], params)
    engine.add_request("1", prompts[1], params)
    for _ in range(3):
        step()
    engine.add_request("2", prompts[2], params)
    engine.add_request("3", prompts[0] + [7, 8, 9, 10, 11, 12, 13, 14], params)
    engine.add_request("gone", prompts[2], params)
    if guided_prompt is not None:
        from k3serve.engine.guided import GuidedDecoding

        gd = GuidedDecoding(engine.vocab_size, engine.eos_token_ids[0], enabled=True)
        proc = gd.processor(json.dumps({"grammars": [{"json_schema": SCHEMA}]}), {}, "json")
        engine.add_request("json", guided_prompt, SamplingParams(temperature=0, max_tokens=3 * max_new),
                           logits_processor=proc)
    step()
    gone = engine.abort_request("gone")
    assert gone is not None and gone.finish_reason == "abort"
    done.update(eh.drain(engine))
    if gd is not None:
        assert not gd.take_failures()
    out = {i: o.token_ids for i, o in done.items()}
    assert "gone" not in out and len(out) == 4 + (guided_prompt is not None)
    assert engine.blocks.num_used == 0 and engine.states.num_running_free == engine.states.max_running
    return out, engine
