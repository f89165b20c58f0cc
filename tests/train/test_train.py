"""A few training steps learn, and the export loads with the normal loader and computes the same function."""

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.models.generate import SimpleRunner
from k3serve.models.kimi import build_model
from k3serve.models.loader import load_model
from training import tasks
from training.data import Encoded
from training.qat import enable_qat
from training.render import encode_sample
from training.tok import load_tokenizer
from training.export import compact_config, export, load_compact, save_compact
from training.init import init_for_training
from training.config import DEFAULT_CONFIG, TrainConfig
from training.train import step_loss
from training.vocab import CompactVocab


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer()
    rng = random.Random(0)
    batch = []
    for kind in ("tool", "json"):
        s = tasks.make(kind, rng, thinking=False)
        ids, n = encode_sample(s, tok)
        batch.append(Encoded(kind, ids, n))
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab({i for e in batch for i in e.ids}, full.text.vocab_size)
    torch.manual_seed(0)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, 0)
    return model, vocab, batch


def test_loss_falls_on_a_repeated_batch(setup):
    model, vocab, batch = setup
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(8):
        if step == 4:
            enable_qat(model)  # QAT switches on mid-run, as in train()
        loss, n = step_loss(model, vocab, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert n == sum(len(e.ids) - e.n_prompt for e in batch)
    assert losses[-1] < 0.5 * losses[0], losses


def test_probe_measures_quantisation_and_keeps_the_qat_state(setup):
    from torch.nn.utils import parametrize

    from training.qat import expert_modules
    from training.train import probe_losses

    model, vocab, batch = setup
    enable_qat(model)
    out = probe_losses(model, vocab, batch)
    assert set(out) == {"probe_loss_float", "probe_loss_mxfp4"}
    assert out["probe_loss_float"] != out["probe_loss_mxfp4"]  # float masters are off the MXFP4 grid
    assert parametrize.is_parametrized(expert_modules(model)[0], "w13")


def test_export_loads_and_matches(setup, tmp_path):
    model, vocab, batch = setup
    enable_qat(model)
    with torch.no_grad():  # bf16-exact masters, so the bf16 export is lossless
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model_dir, bf16_dir = export(model, vocab, DEFAULT_CONFIG, tmp_path)
    loaded, cfg = load_model(model_dir, progress=False)
    assert cfg.experts_mxfp4 and cfg.text.vocab_size == 163840
    ids = batch[0].ids[:60]
    with torch.no_grad():
        from training.forward import train_forward

        want = model.compute_logits(train_forward(model, [torch.tensor(vocab.to_compact(ids))]))[-1]
    got = SimpleRunner(loaded, max_seqs=1, max_len=64).step({0: ids})[0]
    used = torch.tensor(vocab.ids)
    assert torch.allclose(got[used], want, atol=2e-3, rtol=1e-3)
    rest = torch.ones(163840, dtype=torch.bool)
    rest[used] = False
    assert torch.all(got[rest] == 0)
    twin, twin_cfg = load_model(bf16_dir, progress=False)
    assert not twin_cfg.experts_mxfp4
    # a compact snapshot (what a run writes every --save-every steps) exports to the same files
    snap = save_compact(model, tmp_path / "compact" / "step_1.safetensors")
    again = export(load_compact(DEFAULT_CONFIG, vocab, snap), vocab, DEFAULT_CONFIG, tmp_path / "again")
    for a, b in zip((model_dir, bf16_dir), again):
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_continuing_a_run_loads_its_snapshot_and_checks_the_vocabulary(setup, tmp_path):
    import json

    from training.export import load_params

    model, vocab, _ = setup
    snap = save_compact(model, tmp_path / "compact" / "step_3.safetensors")
    fresh = build_model(compact_config(ModelConfig.from_file(DEFAULT_CONFIG), vocab))
    init_for_training(fresh, 1)
    load_params(fresh, vocab, snap)
    want = dict(model.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in fresh.named_parameters())
    (tmp_path / "used_ids.json").write_text(json.dumps(vocab.ids[:-1]))  # the run had another vocabulary
    with pytest.raises(ValueError, match="another vocabulary"):
        load_params(fresh, vocab, snap)


def test_a_continued_run_keeps_the_snapshots_context_heads(setup, tmp_path):
    """training_model sets up only the KDA context heads a snapshot's run did not have: setting them again
    over trained ones reset a continued run (wx21)."""
    import json

    from training.train import training_model

    _, vocab, _ = setup
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    cfg = TrainConfig(out=tmp_path, split_residual=True, split_shifts=2)
    model = training_model(cfg, full, vocab)
    with torch.no_grad():  # as if trained on: every parameter moved
        for p in model.parameters():
            p.add_(0.01)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    (tmp_path / "used_ids.json").write_text(json.dumps(vocab.ids))
    tagged = save_compact(model, tmp_path / "compact" / "step_5.safetensors", {"split_shifts": "2"})
    untagged = save_compact(model, tmp_path / "compact" / "step_6.safetensors")  # older snapshots: no metadata
    (tmp_path / "train_log.json").write_text(json.dumps({"config": {"split_shifts": "2"}}))
    for snap in (tagged, untagged):
        again = training_model(dataclasses.replace(cfg, init_from=str(snap)), full, vocab)
        assert all(torch.equal(p, want[n]) for n, p in again.named_parameters()), snap.name
    # a snapshot of a run without them gets them, in the first (KDA) layer and nowhere else
    (tmp_path / "train_log.json").write_text(json.dumps({"config": {"split_shifts": "0"}}))
    grown = dict(training_model(dataclasses.replace(cfg, init_from=str(untagged)), full, vocab).named_parameters())
    changed = [n for n, p in grown.items() if not torch.equal(p, want[n])]
    assert changed and all(n.startswith("language_model.model.layers.0.self_attn.") for n in changed), changed


def test_export_cli_writes_a_snapshot_step(setup, tmp_path, capsys):
    import json

    from training import export as export_mod

    model, vocab, _ = setup
    save_compact(model, tmp_path / "compact" / "step_7.safetensors", {"config": "/elsewhere/k3-default.json"})
    assert export_mod.main([str(tmp_path)]) == 2  # no used_ids.json yet
    assert "no compact snapshots or no used_ids.json" in capsys.readouterr().err
    (tmp_path / "used_ids.json").write_text(json.dumps(vocab.ids))
    assert export_mod.main([str(tmp_path), "--step", "8"]) == 2
    assert "have [7]" in capsys.readouterr().err
    # the recorded path is another machine's: the package config of the same name is used
    assert export_mod.main([str(tmp_path), "--step", "7"]) == 0
    loaded, cfg = load_model(tmp_path / "step_7" / "model", progress=False)
    assert cfg.experts_mxfp4


def test_config_validation():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(out=".", steps=0)
    with pytest.raises(ValueError, match="device"):
        TrainConfig(out=".", device="tpu")
    with pytest.raises(ValueError, match="one process"):
        TrainConfig(out=".", device="cuda", workers=2)
    with pytest.raises(ValueError, match="no compact snapshot or checkpoint directory"):
        TrainConfig(out=".", init_from="/nonexistent/step_1.safetensors")
    with pytest.raises(ValueError, match="data_seed"):
        TrainConfig(out=".", data_seed=-2)
    with pytest.raises(ValueError, match="stop_after"):
        TrainConfig(out=".", steps=3, stop_after=4)
    with pytest.raises(ValueError, match="progress_from"):
        TrainConfig(out=".", progress_from=1.5)
    with pytest.raises(ValueError, match="copy warm-up share"):
        TrainConfig(out=".", copy_share=1.5)
    with pytest.raises(ValueError, match="lookup_objects"):
        TrainConfig(out=".", lookup_objects=2.0)
    with pytest.raises(ValueError, match="lookup_in"):
        TrainConfig(out=".", lookup_in="prose")
    with pytest.raises(ValueError, match="request form"):
        TrainConfig(out=".", request_form="yaml")


def test_copy_warmup_schedule():
    from training import data

    tok = load_tokenizer()
    vocab = CompactVocab(data.inventory(tok, seed=1, per_kind=30), 163840)
    warm = data.CopyWarmup(share=1.0, until=0.5, after=0.0)
    assert warm.at(0.49) == 1.0 and warm.at(0.5) == 0.0
    batches = list(data.batches(tok, vocab, seed=3, steps=4, tokens_per_step=1200, warmup=warm))
    first, last = [e.kind for e in batches[0]], [e.kind for e in batches[-1]]
    assert set(first) == {"copy"} and "copy" not in last
    # warm-up copies are short and have no system prompt (the shortest K3 chat render)
    assert max(len(e.ids) for e in batches[0]) < 80
    mixed = data.CopyWarmup(share=1.0, until=1.0, lookup=0.4, recall=0.3)
    stream = list(data.batches(tok, vocab, seed=3, steps=4, tokens_per_step=1200, warmup=mixed))
    assert {e.kind for b in stream for e in b} == {"copy", "lookup", "recall"}
    # recall lists follow the curriculum: short (<= 16 records, no thinking) at the start
    first = [len(e.ids) for e in stream[0] if e.kind == "recall"]
    assert first and max(first) < 40 + 16 * 15
    # a continued run (progress_from 1.0) draws the final mix from its first step: long recall lists
    late = list(data.batches(tok, vocab, seed=3, steps=2, tokens_per_step=6000, warmup=mixed, progress_from=1.0))
    assert min(len(e.ids) for b in late for e in b if e.kind == "recall") > 1200
    with pytest.raises(ValueError, match="at most 1"):
        data.CopyWarmup(lookup=0.6, recall=0.6)
    with pytest.raises(ValueError, match="at most 1"):
        data.CopyWarmup(lookup=0.5, recall=0.2, induce=0.4)
    # synthetic copies come from the used ordinary tokens, only while the warm-up lasts
    induce = data.CopyWarmup(share=1.0, until=0.5, induce=1.0)
    stream = list(data.batches(tok, vocab, seed=3, steps=4, tokens_per_step=1200, warmup=induce))
    pool = set(data.token_pool(vocab))
    assert {e.kind for e in stream[0]} == {"induce"} and "induce" not in {e.kind for e in stream[-1]}
    assert all(set(e.ids) <= pool for e in stream[0]) and not pool & set(range(data.SPECIAL_BASE, 163840))
    first = data.CopyWarmup(share=1.0, until=1.0, induce_until=0.5)
    stream = list(data.batches(tok, vocab, seed=3, steps=4, tokens_per_step=1200, warmup=first))
    assert {e.kind for b in stream[:2] for e in b} == {"induce"} and "induce" not in {e.kind for e in stream[-1]}


def test_batches_are_deterministic_and_follow_the_curriculum():
    from training import data

    tok = load_tokenizer()
    vocab = CompactVocab(data.inventory(tok, seed=1, per_kind=30), 163840)

    def run():
        return [[(e.kind, tuple(e.ids)) for e in b]
                for b in data.batches(tok, vocab, seed=2, steps=4, tokens_per_step=1500)]

    a = run()
    assert a == run() and len(a) == 4
    # the GPU path draws the same batches in a helper process
    stats: dict[str, int] = {}
    ahead = data.prefetched(tok, vocab, seed=2, steps=4, tokens_per_step=1500, stats=stats, depth=2)
    assert [[(e.kind, tuple(e.ids)) for e in b] for b in ahead] == a
    assert all(sum(len(ids) for _, ids in b) <= 1500 or len(b) == 1 for b in a)
    assert data.recall_range(0.0) == data.SHORT and data.recall_range(0.95) == data.LONG
    # lists grow monotonically, and recall's token share stays bounded as they do
    ranges = [data.recall_range(p / 20) for p in range(21)]
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(ranges, ranges[1:]))
    shares = [data.recall_weight(p) * sum(data.recall_range(p)) / 2 for p in (0.5, 0.8, 1.0)]
    assert max(shares) <= data.MIX["recall"] * data.RECALL_REF * 1.001


def test_pack_takes_the_oldest_then_what_fits():
    from training import data

    a, b, c, d, e, f = (Encoded("tool", [1] * n, 1) for n in (500, 1500, 300, 200, 900, 2500))
    waiting = [a, b, c, d, e, f]
    assert data.pack(waiting, 1000) == [a, c, d] and waiting == [b, e, f]  # the rest keep their order
    assert data.pack(waiting, 1000) == [b]  # the oldest goes even over the budget, alone
    assert data.pack(waiting, 1000) == [e] and data.pack(waiting, 1000) == [f] and waiting == []


def test_lookahead_packs_fuller_batches_of_the_same_samples():
    from training import data

    tok = load_tokenizer()
    vocab = CompactVocab(data.inventory(tok, seed=1, per_kind=30), 163840)
    kwargs = {"seed": 4, "steps": 40, "tokens_per_step": 3000, "progress_from": 1.0}
    plain = list(data.batches(tok, vocab, **kwargs))
    packed = list(data.batches(tok, vocab, lookahead=3, **kwargs))
    assert packed == list(data.batches(tok, vocab, lookahead=3, **kwargs))  # deterministic
    assert all(sum(len(e.ids) for e in b) <= 3000 or len(b) == 1 for b in packed)
    # the same draws, packed differently: every packed sample is one the plain stream drew (a longer run of it
    # holds the samples still waiting), in the drawn order within a batch, and no batch's first sample waits
    # behind a later one
    drawn = (e for b in data.batches(tok, vocab, **{**kwargs, "steps": 60}) for e in b)
    order = {tuple(e.ids): i for i, e in enumerate(drawn)}
    index = [[order[tuple(e.ids)] for e in b] for b in packed]
    assert all(i == sorted(i) for i in index) and [i[0] for i in index] == sorted(i[0] for i in index)

    def spread(stream):
        sizes = [sum(len(e.ids) for e in b) for b in stream]
        return sum(abs(a - b) for a, b in zip(sizes, sizes[1:])) / (len(sizes) - 1)

    assert spread(packed) < 0.5 * spread(plain)  # ~70 against ~420 tokens


def test_task_mix_replaces_the_default_weights():
    from training import data

    assert data.parse_mix("") == data.MIX
    mix = data.parse_mix(" recall=0, choose=0.5 ")
    assert mix == {**data.MIX, "recall": 0.0, "choose": 0.5}
    for bad, msg in (("recal=0", "kind=weight"), ("recall", "kind=weight"), ("tool=x", "not a number"),
                     ("tool=-1", ">= 0"), ("tool=nan", ">= 0"), ("tool=inf", ">= 0"),
                     (",".join(f"{k}=0" for k in data.MIX), "positive")):
        with pytest.raises(ValueError, match=msg):
            data.parse_mix(bad)
    with pytest.raises(ValueError, match="kind=weight"):
        TrainConfig(out=".", mix="foo=1")
    # outside the warm-up the kinds follow the mix: a zero weight is never drawn, a larger one more often
    rng = random.Random(0)
    drawn = [data.sample_kind(rng, progress=0.9, mix=mix) for _ in range(3000)]
    assert "recall" not in drawn and set(drawn) == set(data.MIX) - {"recall", "session"}
    assert drawn.count("choose") > 1.5 * drawn.count("tool")
    tok = load_tokenizer()
    vocab = CompactVocab(data.inventory(tok, seed=1, per_kind=30), 163840)
    stream = data.batches(tok, vocab, seed=3, steps=3, tokens_per_step=3000, progress_from=1.0,
                          mix=data.parse_mix("tool=0,choose=0,decline=0,json=0,followup=0"))
    assert {e.kind for b in stream for e in b} == {"recall"}


def test_keep_freed_memory_applies_on_glibc_in_a_child():
    """The training processes' allocator settings apply on Linux/glibc (checked in a child process, so the
    test process keeps its own allocator behaviour)."""
    import subprocess
    import sys

    code = "from training.parallel import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ("True" if sys.platform.startswith("linux") else "False")


def test_train_cli_explains_every_flag_and_rejects_bad_values_in_one_line(capsys):
    from training import config, train as train_mod

    with pytest.raises(SystemExit) as e:
        train_mod.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text
    assert set(config.HELP) == {f.name for f in dataclasses.fields(TrainConfig)} - {"out"}
    for bad in (["--steps", "0"], ["--device", "tpu"], ["--qat-from", "2"], ["--mix", "recal=0"]):
        with pytest.raises(SystemExit) as e:
            train_mod.main(["--out", "unused", *bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("python -m training.train: error: ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux-only")
def test_spawned_ranks_stop_when_the_launcher_is_killed(tmp_path):
    """``kill`` on a CPU run's launcher must not leave its ranks training on (started from a shell, as
    ``nohup ... &`` does, they used to survive it)."""
    pids, parent = tmp_path / "pids", tmp_path / "parent"
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        from training import parallel
        def work(rank, world):
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(120)
        if __name__ == "__main__":
            parallel.launch(work, 2)
    """))
    root = str(Path(__file__).resolve().parents[2])  # training/ is not installed: the child finds it here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    shell = subprocess.Popen(["bash", "-c", f"{sys.executable} {script} & echo $! > {parent}; wait"], env=env)
    ranks: list[int] = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and (not pids.exists() or len(pids.read_text().split()) < 2):
            time.sleep(0.2)
        ranks = [int(x) for x in pids.read_text().split()]
        assert len(ranks) == 2
        os.kill(int(parent.read_text()), signal.SIGTERM)  # what `kill` and `pkill` send
        shell.wait(timeout=30)
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(pid) for pid in ranks):
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        shell.kill()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_synthetic_copies_lengthen_only_when_asked():
    from training import data

    assert data.induce_items(0.9) == data.induce_items(0.0) == data.INDUCE_ITEMS
    assert data.induce_items(0.0, 300) == data.INDUCE_ITEMS
    assert data.induce_items(data.RAMP[1], 300) == data.induce_items(1.0, 300) == (data.INDUCE_ITEMS[0], 300)
    lo, hi = data.induce_items(data.RAMP[1] / 2, 300)
    assert data.INDUCE_ITEMS[1] < hi < 300
    pool = list(range(1000, 2000))
    warm = data.CopyWarmup(induce_until=1.0, induce_long=300)
    e = data.draw(random.Random(0), None, 0.99, warm, pool=pool)
    assert e.kind == "induce" and len(e.ids) - e.n_prompt <= 300
    with pytest.raises(ValueError, match="induce_long"):
        data.CopyWarmup(induce_long=-1)


@torch.no_grad()
def test_init_options_shape_the_attention_layers():
    from k3serve.layers.kda import KimiDeltaAttention
    from k3serve.layers.mla import MLAttention
    from training.init import MLA_SCALED

    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(range(1000, 1400), full.text.vocab_size)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, 0, mla_init_std=0.125, prev_token_init=1)
    for m in model.modules():
        if isinstance(m, MLAttention):
            for name in MLA_SCALED:
                assert abs(getattr(m, name).weight.std().item() - 0.125) < 0.02
    first = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    heads = []
    first.o_norm.register_forward_hook(lambda mod, args, out: heads.append(args[0]))  # [N, H, K] before the norm
    ids = torch.tensor(vocab.to_compact(list(range(1000, 1012))))
    other = ids.clone()
    other[5] = vocab.to_compact([1300])[0]
    for x in (ids, other):
        from training.forward import train_forward
        train_forward(model, [x])
    diff = (heads[0] - heads[1]).abs().amax(-1)  # [N, H]
    # head 0 reads the token before: a change at 5 shows at 5 (gate, beta) and 6 (the value), ~nothing later.
    # Earlier positions see it only at rounding level: the chunked form factors decays through a reference
    # position of the (sub-)chunk, which may lie after them.
    assert diff[:5].max() < 1e-6 and diff[6, 0] > 100 * diff[7:, 0].max()
    assert diff[8:, 1:].max() > 100 * diff[8:, 0].max()  # the other heads keep a memory


def test_train_runs_its_loop_and_writes_snapshots(tmp_path):
    """Two steps of ``train()`` itself: expert-load balancing, logging, compact snapshots, final probe."""
    from training.train import train

    cfg = TrainConfig(out=tmp_path, steps=2, tokens_per_step=256, log_every=1, save_every=2, warmup=1)
    model, vocab, log = train(cfg, load_tokenizer())
    assert [e["step"] for e in log if "loss" in e] == [1, 2]
    assert (tmp_path / "compact" / "step_2.safetensors").is_file()
    assert "probe_loss_mxfp4" in log[-1]["final"]
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases)  # the loads moved the router biases
    # continued from its snapshot (same --seed: same vocabulary), --data-seed draws other batches
    snap = str(tmp_path / "compact" / "step_2.safetensors")
    first = {}
    for d in (-1, 0, 7):
        (tmp_path / f"c{d}").mkdir()
        again = dataclasses.replace(cfg, out=tmp_path / f"c{d}", init_from=snap, steps=1, save_every=0, data_seed=d)
        first[d] = next(e["loss"] for e in train(again, load_tokenizer())[2] if "loss" in e)
    assert first[-1] == first[0] != first[7]


def test_stop_after_ends_a_run_as_the_first_steps_of_the_whole_one(tmp_path):
    """``--stop-after`` keeps the schedule and batches of ``--steps``: its last snapshot equals the whole run's
    snapshot at that step, and it goes no further."""
    from safetensors.torch import load_file

    from training.train import lr_at, train

    whole = TrainConfig(out=tmp_path / "whole", steps=3, tokens_per_step=256, log_every=1, save_every=1, warmup=0)
    assert lr_at(whole, 1) != lr_at(dataclasses.replace(whole, steps=2), 1)  # a 2-step schedule would differ
    stopped = dataclasses.replace(whole, out=tmp_path / "stopped", stop_after=2)
    for cfg in (whole, stopped):
        cfg.out.mkdir()
        log = train(cfg, load_tokenizer())[2]
    assert [e["step"] for e in log if "loss" in e] == [1, 2] and log[-1]["step"] == 2
    assert sorted(p.name for p in (stopped.out / "compact").iterdir()) == ["step_1.safetensors", "step_2.safetensors"]
    a, b = (load_file(c.out / "compact" / "step_2.safetensors") for c in (whole, stopped))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
