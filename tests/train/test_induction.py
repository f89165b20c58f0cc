"""MLA attention supervision: the induction targets, and the loss against the layer's own attention."""

import json
import random

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.layers.mla import MLAttention
from k3serve.models.kimi import build_model
from k3serve.ops.mla.naive import naive_mla_attention
from training import data, induction
from training.export import compact_config
from training.forward import train_forward
from training import tasks
from training.induction import (MLAInputs, attention_loss, follow_targets, head_qk, induced_positions,
                                     induction_targets, lookup_targets)
from training.keyed import (describe_targets, key_targets, name_targets, type_targets, value_positions,
                                 verdict_targets)
from training.render import encode_sample
from training.tok import load_tokenizer
from training.init import init_for_training
from training.config import DEFAULT_CONFIG
from training.train import step_loss
from training.vocab import CompactVocab


def test_targets_are_the_positions_after_earlier_occurrences():
    #      0  1  2  3  4  5  6  7  8
    ids = [7, 1, 2, 3, 9, 1, 2, 3, 1]
    # answer tokens at 6..8: predecessors t = 5 (1 -> next 2: j = 2), 6 (2 -> 3: j = 3), 7 (3 -> 1: none, the
    # only 3 before is followed by 9)
    assert induction_targets(ids, [(6, 9)]) == [(5, [2]), (6, [3])]
    # a source must be visible to the query (j <= t); several spans are read in order
    assert induction_targets([4, 4, 4], [(1, 2), (2, 3)]) == [(1, [1])]
    assert induction_targets(ids, [(6, 9)], max_sources=0) == []
    # the misses: t = 7 (3 occurred at 3, followed by 9, not by the answer's 1), but only where the answer
    # repeats itself: the 3 at 3 is in the prompt
    assert induction_targets(ids, [(6, 9)], misses=True) == []
    assert induction_targets(ids, [(2, 9)], misses=True) == [(7, [4])]
    assert induction_targets([5, 1, 2, 1, 3], [(2, 5)], misses=True) == [(3, [2])]
    assert induction_targets([5, 1, 2, 1, 3], [(4, 5)], misses=True) == []  # the 1 at 1 is in the prompt
    assert induction_targets([5, 1, 2, 1, 3], [(2, 5)], misses=True, max_sources=0) == []


def test_lookups_are_answer_tokens_in_the_prompt_that_no_induction_step_gives():
    #      0  1  2  3  4  5  6  7  8
    ids = [7, 1, 2, 3, 9, 5, 1, 3, 163590]
    # answer 6..8: t = 5 (5 -> 1: 1 stands at 1, no earlier 5), t = 6 (1 -> 3: at 3, but 1 was followed by
    # 2), t = 7 (3 -> special: never looked up)
    assert lookup_targets(ids, [(6, 9)]) == [(5, [1]), (6, [3])]
    # an induction step is not a lookup; only prompt positions (before the answer) count; the cap
    assert lookup_targets([7, 1, 2, 1, 2], [(4, 5)]) == []
    assert lookup_targets([7, 1, 2, 5, 2], [(3, 5)]) == [(3, [2])]  # t = 2: the 5 is not in the prompt
    assert lookup_targets([7, 1, 1, 1, 1, 1, 8, 1], [(7, 8)]) == []


def test_only_keeps_the_targets_at_those_answer_positions():
    ids = [7, 1, 2, 3, 9, 5, 1, 3, 163590]
    assert lookup_targets(ids, [(6, 9)], only={7}) == [(6, [3])]
    assert lookup_targets(ids, [(6, 9)], only=set()) == []
    assert induction_targets([7, 1, 2, 3, 9, 1, 2, 3, 1], [(6, 9)], only={7}) == [(6, [3])]


def test_induced_positions_are_the_uncapped_induction_targets():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 40)
        ids = [rng.randint(0, 5) for _ in range(n)]
        cuts = sorted(rng.sample(range(1, n + 1), min(n, 4)))  # one or two answer spans
        answers = [(cuts[0], cuts[1])] + ([(cuts[2], cuts[3])] if len(cuts) == 4 and rng.random() < 0.5 else [])
        want = {t for t, _ in induction_targets(ids, answers, max_sources=len(ids))}
        assert induced_positions(ids, answers) == want


def test_follow_targets_point_a_value_end_at_what_follows_it_in_the_request():
    #      0  1  2  3  4 | 5  6  7  8
    ids = [9, 5, 6, 7, 8, 5, 6, 4, 2]
    # t = 5 (5 -> 6) is an induction step (j = 2), t = 6 (6 -> 4) is none: the request's 6 is followed at j = 3;
    # t = 7 (4) stands nowhere in the prompt
    assert follow_targets(ids, [(5, 9)]) == [(6, [3])]
    assert follow_targets(ids, [(5, 9)], max_sources=0) == [] and follow_targets(ids, [(5, 9)], only={5}) == []
    # a JSON answer: every string value's last token points at the request's '"\n' (or '"' at the end) after it
    tok = load_tokenizer()
    ends = 0
    for seed in range(8):
        s = tasks.make("json", random.Random(seed), thinking=False, style=tasks.SHIPPED)
        ids, n = encode_sample(s, tok)
        only = value_positions(ids, "json")
        got = dict(follow_targets(ids, [(n, len(ids))], only=only))
        for t, sources in got.items():
            assert t in only and all(j < n and ids[j - 1] == ids[t] for j in sources)
        for t in range(n, len(ids) - 1):
            if tok.decode([ids[t + 1]]) in ('","', '"}') and t in got:
                assert {tok.decode([ids[j]]) for j in got[t]} & {'"\n', '"'}
                ends += 1
    assert ends >= 8


def test_a_synthetic_copy_has_a_source_for_every_answer_token():
    rng = random.Random(3)
    e = data.induce_sample(rng, list(range(1000, 1400)), (12, 12))
    got = induction_targets(e.ids, e.answers)
    n = e.n_prompt
    assert [t for t, _ in got] == list(range(n - 1, len(e.ids) - 1))
    assert all(len(s) == 1 and e.ids[s[0]] == e.ids[t + 1] for t, s in got)


@pytest.fixture(scope="module")
def model():
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(set(range(1000, 1400)), full.text.vocab_size)
    m = build_model(compact_config(full, vocab))
    init_for_training(m, 0, mla_init_std=0.3)  # sharper than the default, so the check is not on a flat softmax
    return m, vocab


def test_loss_is_minus_log_of_the_layers_own_attention_mass(model):
    m, vocab = model
    rng = random.Random(0)
    seqs = [data.induce_sample(rng, list(range(1000, 1400)), (6, 9)) for _ in range(2)]
    ids = [torch.tensor(vocab.to_compact(e.ids)) for e in seqs]
    targets = [induction_targets(e.ids, e.answers) for e in seqs]
    with torch.no_grad(), MLAInputs(m) as taps:
        train_forward(m, ids)
    loss, count = attention_loss(taps, [len(e.ids) for e in seqs], targets)
    assert count == sum(len(t) for t in targets) > 0

    # the same mass from the naive MLA spec: head 0's output with values that are one-hot positions
    expected, n_terms = 0.0, 0
    for layer, x in zip(taps.layers, taps.inputs):
        off = 0
        for e, tgt in zip(seqs, targets):
            n = len(e.ids)
            q, _ = head_qk(layer, x[off:off + n])
            lat = layer.latents(x[off:off + n]).float()
            C, dn = layer.kv_lora_rank, layer.nope_dim
            # kv_b rows for one head whose values read a position one-hot: latents carry the position
            onehot_lat = torch.cat([lat[:, :C], torch.eye(n), lat[:, C:]], -1)
            w = layer.kv_b_proj.weight[:dn].float()
            kv_b = torch.cat([torch.cat([w, torch.zeros(dn, n)], 1), torch.cat([torch.zeros(n, C), torch.eye(n)], 1)])
            # naive spec with latents [c | onehot] as its C + n "latent" and the rope part after
            p = naive_mla_attention(q[:, None], onehot_lat, kv_b, nope_dim=dn, v_dim=n, scale=layer.scale)[:, 0]
            for t, sources in tgt:
                expected -= torch.log(p[t, sources].sum()).item()
                n_terms += 1
            off += n
    assert loss.item() == pytest.approx(expected / n_terms, rel=1e-4)


def test_step_loss_adds_the_supervision_and_its_gradient_reaches_the_queries(model):
    m, vocab = model
    rng = random.Random(1)
    batch = [data.induce_sample(rng, list(range(1000, 1400)), (8, 8)) for _ in range(2)]
    plain, _ = step_loss(m, vocab, batch)
    kinds: dict = {}
    m.zero_grad()
    sup, _ = step_loss(m, vocab, batch, kinds, {"attn": 0.5})
    assert sup.item() == pytest.approx(plain.item() + 0.5 * kinds["attn"][0] / kinds["attn"][1], rel=1e-5)
    sup.backward()
    mla = next(x for x in m.modules() if isinstance(x, MLAttention))
    assert mla.q_b_proj.weight.grad[: mla.qk_dim].abs().sum() > 0  # head 0's query rows


@torch.no_grad()
def test_context_heads_write_the_tokens_before_into_the_second_half():
    from k3serve.layers.kda import KimiDeltaAttention
    from training.init import SHIFT_DECAY, SPLIT_GAIN, context_heads

    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(set(range(1000, 1400)), full.text.vocab_size)
    m = build_model(compact_config(full, vocab))
    init_for_training(m, 0, split_residual=True)
    kda = next(x for x in m.modules() if isinstance(x, KimiDeltaAttention))
    half, K = full.text.hidden_size // 2, kda.head_dim
    context_heads(kda, 3, half)
    kda.g_proj.weight.zero_()  # output gate sigmoid(0) = 1/2 everywhere, for a closed-form expectation
    seen = []
    hook = kda.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    train_forward(m, [torch.tensor(vocab.to_compact(random.Random(0).sample(range(1000, 1400), 40)))])
    hook.remove()
    x, out = seen[0]
    n = min(K, half)

    def feature(v: torch.Tensor) -> torch.Tensor:  # a head's value, RMS-normed and gated, as the layer writes it
        v = torch.nn.functional.silu(v[:n].float())
        return v * torch.rsqrt(v.pow(2).mean() + full.text.rms_norm_eps) * 0.5

    for t in range(3, 40):
        want = sum(SPLIT_GAIN * SHIFT_DECAY ** h * feature(x[t - 1 - h, :n]) for h in range(3))
        got = out[t, half:half + n].float()
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.98, t
    with pytest.raises(ValueError, match="split shifts"):
        context_heads(kda, 4, half)


def test_the_miss_loss_is_minus_log_of_the_mass_off_the_wrong_candidates(model):
    m, vocab = model
    rng = random.Random(2)
    toks = rng.sample(range(1000, 1400), 30)
    ids = toks + toks[:10] + [toks[3], 1399 if toks[4] != 1399 else 1398]  # the last copy goes wrong
    answers = [(1, len(ids))]
    misses = induction_targets(ids, answers, misses=True)
    # toks[9] -> toks[3] (its only earlier follower is toks[10]); toks[3] -> other (followed by toks[4] twice)
    assert misses == [(39, [10]), (40, [4, 34])]
    with torch.no_grad(), MLAInputs(m) as taps:
        train_forward(m, [torch.tensor(vocab.to_compact(ids))])
    loss, count = attention_loss(taps, [len(ids)], [misses], avoid=True)
    assert count == len(misses)
    expected = 0.0
    for layer, x in zip(taps.layers, taps.inputs):
        q, k = head_qk(layer, x)
        n = len(ids)
        scores = (q @ k.T * layer.scale).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        p = scores.softmax(-1)
        expected -= sum(torch.log(1 - p[t, c].sum()).item() for t, c in misses)
    assert loss.item() == pytest.approx(expected / (count * len(taps.layers)), rel=1e-4)
    plain, _ = attention_loss(taps, [len(ids)], [misses])
    assert plain.item() != pytest.approx(loss.item())  # the other side of the same mass


def test_step_loss_supervises_the_lookups_in_values_and_the_types():
    tok = load_tokenizer()
    s = tasks.make("tool", random.Random(2), style=tasks.Style("lines", "check", "decide", "restate"))
    e = data.Encoded("tool", *encode_sample(s, tok))
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(set(e.ids), full.text.vocab_size)
    m = build_model(compact_config(full, vocab))
    init_for_training(m, 0)
    only = value_positions(e.ids, e.kind)
    for where, lookups in (("all", lookup_targets(e.ids, e.answers)),
                           ("values", lookup_targets(e.ids, e.answers, only=only))):
        kinds: dict = {}
        step_loss(m, vocab, [e], kinds, {k: 0.5 for k in induction.KINDS if k not in ("attn", "miss")}, where)
        assert kinds["lookup_attn"][1] == len(lookups)  # by_kind counts the supervised positions
        assert kinds["type_attn"][1] == len(type_targets(e.ids, e.answers)) > 0
        assert kinds["follow_attn"][1] == len(follow_targets(e.ids, e.answers, only=only)) > 0  # always in values
        assert kinds["key_attn"][1] == len(key_targets(e.ids, e.answers)) > 0
        assert kinds["name_attn"][1] == len(name_targets(e.ids, e.answers)) == 1
        assert kinds["spell_attn"][1] == len(name_targets(e.ids, e.answers, spell=True)) > 0
        assert kinds["verdict_attn"][1] == len(verdict_targets(e.ids, e.answers)) == 1
        assert kinds["describe_attn"][1] == len(describe_targets(e.ids, e.answers)) == 1
    with pytest.raises(ValueError, match="unknown attention supervision"):
        step_loss(m, vocab, [e], None, {"names": 0.5})
    assert len(lookup_targets(e.ids, e.answers, only=only)) < len(lookup_targets(e.ids, e.answers))
