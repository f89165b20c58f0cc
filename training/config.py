"""A training run's settings: ``TrainConfig`` (frozen, validated at construction), the ``--help`` of every
field (``HELP``) and the parser arguments made from them (``add_arguments``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from k3serve.models.registry import CONFIG_DIR
from training import data, tasks
from training.grow import is_checkpoint_dir

DEFAULT_CONFIG = CONFIG_DIR / "k3-default.json"


@dataclass(frozen=True)
class TrainConfig:
    """A training run; every field is a flag of the same name, described in ``HELP`` (``--help``)."""

    out: Path
    config: Path = DEFAULT_CONFIG
    seed: int = 0
    data_seed: int = -1
    steps: int = 900
    stop_after: int = 0
    tokens_per_step: int = 4096
    pack_lookahead: float = 0.0
    lr: float = 3e-3
    warmup: int = 30
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    qat_from: float = 0.6
    bias_update: float = 1e-3
    threads: int = 1
    workers: int = 1
    log_every: int = 10
    save_every: int = 0
    device: str = "cpu"
    init_from: str = ""
    progress_from: float = 0.0
    copy_share: float = 0.0
    copy_until: float = 0.0
    copy_after: float = 0.0
    lookup_frac: float = 0.0
    recall_frac: float = 0.0
    induce_frac: float = 0.0
    induce_until: float = 0.0
    assoc_frac: float = 0.0
    induce_long: int = 0
    history_frac: float = 0.0
    lookup_objects: float = 0.0
    tool_leaves: int = tasks.TOOL_LEAVES
    decline_object: float = 0.0
    choose_object: float = 0.0
    array_repeats: float = 0.0
    array_twins: float = 0.0
    hard_from: float = 0.0
    mix: str = ""
    request_form: str = "inline"
    reasoning: str = "plain"
    nothink: str = "bare"
    recall_form: str = "passage"
    embed_std: float = 1.0
    mla_init_std: float = 0.0
    prev_token_init: int = 0
    attn_sup: float = 0.0
    attn_miss: float = 0.0
    attn_lookup: float = 0.0
    lookup_in: str = "all"
    attn_types: float = 0.0
    attn_follow: float = 0.0
    attn_keys: float = 0.0
    attn_names: float = 0.0
    attn_spell: float = 0.0
    attn_verdict: float = 0.0
    attn_describe: float = 0.0
    split_residual: bool = False
    split_shifts: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "tokens_per_step", "threads", "workers", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after must be in [0, steps={self.steps}]")
        if self.data_seed < -1:
            raise ValueError("data_seed must be >= 0, or -1 for --seed")
        if self.split_shifts < 0:
            raise ValueError("split_shifts must be >= 0")
        if self.lookup_in not in ("all", "values"):
            raise ValueError(f"lookup_in must be 'all' or 'values', got {self.lookup_in!r}")
        if self.pack_lookahead < 0:
            raise ValueError("pack_lookahead must be >= 0")
        if self.save_every < 0:
            raise ValueError("save_every must be >= 0")
        if not 0.0 <= self.qat_from <= 1.0:
            raise ValueError("qat_from must be in [0, 1]")
        if not 0.0 <= self.progress_from <= 1.0:
            raise ValueError("progress_from must be in [0, 1]")
        if not 0.0 <= self.history_frac <= 1.0:
            raise ValueError("history_frac must be in [0, 1]")
        if self.init_from and not (Path(self.init_from).is_file() or is_checkpoint_dir(Path(self.init_from))):
            raise ValueError(f"init_from: no compact snapshot or checkpoint directory at {self.init_from}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device != "cpu" and self.workers != 1:
            raise ValueError("a GPU run uses one process (--workers 1)")
        self.style  # validates
        self.copy_warmup  # validates
        self.task_mix  # validates

    @property
    def task_mix(self) -> dict[str, float]:
        return data.parse_mix(self.mix)

    @property
    def attn_weights(self) -> dict[str, float]:
        """Weight of each MLA attention supervision (``induction.KINDS``), in the order their losses add up."""
        return {"attn": self.attn_sup, "miss": self.attn_miss, "lookup_attn": self.attn_lookup,
                "type_attn": self.attn_types, "follow_attn": self.attn_follow, "key_attn": self.attn_keys,
                "name_attn": self.attn_names, "spell_attn": self.attn_spell, "verdict_attn": self.attn_verdict,
                "describe_attn": self.attn_describe}

    @property
    def style(self) -> tasks.Style:
        return tasks.Style(self.request_form, self.reasoning, self.nothink, self.recall_form)

    @property
    def copy_warmup(self) -> data.CopyWarmup:
        return data.CopyWarmup(self.copy_share, self.copy_until, self.copy_after, self.lookup_frac,
                              self.recall_frac, self.induce_frac, self.induce_until, self.assoc_frac,
                              self.induce_long, self.lookup_objects, self.tool_leaves, self.decline_object,
                              self.choose_object, self.hard_from, self.array_repeats,
                              self.array_twins)


HELP = {
    "config": "model config of the full-vocabulary model to train (HF K3 config.json)",
    "seed": "seed of the data, the init and the run (same seed, workers, threads -> same run)",
    "data_seed": "seed of the training batches alone (-1: --seed); a run continued from a snapshot keeps the "
                 "snapshot's --seed (its vocabulary) and draws batches it has not seen with another",
    "steps": "optimizer steps (the length of the learning-rate schedule and the curriculum)",
    "stop_after": "end the run after this many of --steps, the schedule and the batches unchanged (0: all "
                  "--steps); the run so far is exactly the first steps of the whole one",
    "tokens_per_step": "tokens per step and per worker (whole samples, packed)",
    "pack_lookahead": "pack each batch from a pool of drawn samples holding this many batches' tokens (oldest "
                      "first, then each later one that fits): nearly full batches of nearly equal length, so the "
                      "workers wait less for each other (0: in the order drawn, a batch ends at the first sample "
                      "that does not fit)",
    "lr": "peak AdamW learning rate",
    "warmup": "steps of linear learning-rate warm-up (then cosine decay)",
    "min_lr_frac": "final learning rate as a fraction of --lr",
    "weight_decay": "AdamW weight decay",
    "clip": "gradient-norm clip",
    "qat_from": "fraction of the steps after which experts train under MXFP4 fake-quant (1.0: never)",
    "bias_update": "step of the aux-loss-free expert balancing bias (e_score_correction_bias)",
    "threads": "torch threads per process",
    "workers": "data-parallel processes on the CPU (one per core; a GPU run uses 1)",
    "log_every": "steps between log lines (loss, tokens/s, per-kind answer loss)",
    "save_every": "also write a compact snapshot <out>/compact/step_<k>.safetensors every this many steps (0: off)",
    "device": "cpu, or cuda[:N] to train on one GPU",
    "init_from": "continue from this compact snapshot (same data code and seed), or start from an HF-format "
                 "checkpoint directory (KDA heads may grow wider: training/grow.py), instead of a fresh init",
    "progress_from": "start the curriculum at this fraction of its course (1.0: the final task mix throughout)",
    "copy_share": "share of warm-up samples (plain copies, lookups, short recall lists) until --copy-until",
    "copy_until": "fraction of the steps until which --copy-share holds",
    "copy_after": "share of warm-up samples after --copy-until",
    "lookup_frac": "fraction of the warm-up samples that are key -> value lookups",
    "recall_frac": "fraction of the warm-up samples that are recall lists",
    "induce_frac": "fraction of the warm-up samples that are synthetic token copies (raw ids, not chats)",
    "induce_until": "fraction of the steps at the start in which every sample is a synthetic token copy",
    "assoc_frac": "fraction of the synthetic samples that are associative recall (keyed values asked back) instead of copies",
    "induce_long": "synthetic copies lengthen with the recall lists up to this many tokens (0: 4-24 throughout)",
    "history_frac": "fraction of the samples (not recall lists) with 1-3 earlier short exchanges in front",
    "lookup_objects": "fraction of the lookups that ask keys in quotes and are answered as an object (the "
                      "call's key tokens)",
    "tool_leaves": f"tool, choose and decline requests have 1 to this many argument leaves (evaluations: "
                   f"{tasks.TOOL_LEAVES}, declines {tasks.DECLINE_LEAVES}; more teaches a call not to close after "
                   "the usual count)",
    "decline_object": "fraction of the declines that ask for a tool sharing its object with an offered one "
                      "(convert_road with share_road offered; drawn as evaluations draw them, about 1 in 8 do)",
    "choose_object": "fraction of the choices that offer, beside the picked tool, one with its object and another "
                     "verb (share_road beside convert_road), so that such a tool in the offer does not mean a "
                     "decline",
    "array_repeats": "fraction of the array values in tool, choose and JSON requests that write one word twice "
                     "(drawn freely about 3%% do: too few to learn where such an array ends)",
    "array_twins": "fraction of those arrays (--array-repeats) that write the repeated word last, beside its twin "
                   "([\"river\",\"island\",\"island\"]; --array-repeats alone puts the twins last in about a quarter "
                   "of the three-word arrays)",
    "hard_from": "curriculum progress from which --decline-object and --choose-object apply (0: throughout)",
    "mix": "task weights after the warm-up, each replacing its default (recall's is scaled down as its lists "
           "lengthen, to keep its token share): e.g. recall=0,choose=0.3; defaults: "
           + ",".join(f"{k}={v}" for k, v in data.MIX.items()),
    "request_form": "how requests write the values to use: inline ('city \"Paris\"; unit ...') or lines (one "
                    "'city: \"Paris\"' per line: the key is the token the call writes)",
    "reasoning": "how a decline's reasoning decides: plain ('No tool does that.') or check (names the tool that "
                 "would do it, then 'is not offered', as a call's reasoning names the tool it calls) or assign (check, with "
                 "the name written as the call writes it: 'The tool=\"get_weather\" does that.') or list (check, after "
                 "'Tools that VERB: ...' lists the offered tools with the asked verb, or none) or quote (check, with the name "
                 "in quotes as declared: 'The tool \"get_weather\" does that.')",
    "nothink": "what tool, choose and decline answers say without thinking: bare (a call's content is empty) or "
               "decide (the content opens with the reasoning's sentences, so the name comes before the decision)",
    "recall_form": "how recall lists write records and the answer copies one: passage ('Record 237: \"w1 ...\"', "
                   "answered 'w1 ...') or restate ('Record 237 w1 ...', answered with that line)",
    "embed_std": "std of the initial embedding rows (tied with lm_head)",
    "prev_token_init": "start head 0 of this many leading KDA layers as a previous-token head (0: none)",
    "attn_sup": "weight of the loss that teaches head 0 of each MLA layer to attend where an induction head "
                "would (training/induction.py; 0: off)",
    "attn_miss": "weight of the loss that teaches the same heads not to copy where an induction copy would be "
                 "wrong (the token occurred before in the same answer, never followed by the next token; 0: off)",
    "attn_lookup": "weight of the loss that teaches head 1 of each MLA layer to attend to the prompt positions "
                   "holding the next answer token where no induction step gives it (training/induction.py; 0: off)",
    "lookup_in": "where the lookups are supervised: all (every answer token) or values (a call's argument blocks "
                 "and a JSON answer; warm-ups and recall whole: the reasoning and the tool's name are left alone)",
    "attn_types": "weight of the loss that points head 1's query at an argument's type to where the request "
                  "writes that key's value (its first token shows the type; training/induction.py; 0: off)",
    "attn_follow": "weight of the loss that points head 0's query at a copied value's token, where the answer's "
                   "next token is no copy (the value's end), to the request position after the same token "
                   "(training/induction.py follow_targets; 0: off)",
    "attn_keys": "weight of the loss that points head 1's query before an argument's or JSON answer's key to where "
                 "the request's line for that key starts (training/keyed.py key_targets; 0: off)",
    "attn_names": "weight of the loss that points head 1's query at a call's tool=\" to where the reasoning and the "
                  "declarations wrote the tool's name (training/keyed.py name_targets; 0: off)",
    "attn_spell": "weight of the loss that points head 1's query at each token of a call's tool name but the "
                  "last to the next token of the same name where the reasoning and the declarations wrote it "
                  "(book_hotel beside book_flight: the choice falls at _hotel; training/keyed.py name_targets spell; "
                  "0: off)",
    "attn_verdict": "weight of the loss that points head 1's query at the reasoning's 'The tool NAME' (before "
                    "'does'/'is') to where the declarations wrote NAME, or to the first position when none does "
                    "(a decline; training/keyed.py verdict_targets; 0: off)",
    "attn_describe": "weight of the loss that points head 2's query at the reasoning's 'wants to VERB the OBJ.' "
                     "(OBJ) to the offered tool's description 'Use this to VERB the OBJ.', or to position 0 when "
                     "none says it (training/keyed.py describe_targets; 0: off)",
    "split_residual": "start token embeddings in the first half of the residual and a previous-token KDA head "
                      "writing the second half, for MLA keys to match on (training/init.py)",
    "split_shifts": "make heads 0..N-1 of the first KDA layer previous-token heads for the N tokens before, "
                    "written into the residual's second half with halving gains (training/init.py context_heads; "
                    "0: leave them)",
    "mla_init_std": "std of the initial MLA q_b/kv_a/kv_b/o projections (0: the writer's flat 0.02)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="run directory (checkpoints, logs)")
    for f in dataclasses.fields(TrainConfig):
        if isinstance(f.default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true", help=HELP[f.name])
        elif f.name != "out":
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default) if f.name != "config" else Path,
                           default=f.default, help=HELP[f.name] + " (default: %(default)s)")
