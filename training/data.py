"""Training data: the curriculum, the used-id inventory and packed batches of encoded samples.

Curriculum (by fraction of training steps): the recall list grows from a few records to >= 2k-token
contexts, so copying and lookup are learnt on cheap sequences before they are stretched; its sampling
weight shrinks as it grows (``recall_weight``), so recall stays about a third of the tokens instead of
taking most of them (long lists right after the warm-up take 44-59% of the tokens):

    progress     recall records (~14 tokens each)
    0.0-0.3      4-16      (the warm-up's short recall)
    0.3-0.75     grows to 110-175
    0.75-1.0     110-175   (1.6k-2.5k tokens)

A batch is a list of ``(ids, n_prompt)`` whose total length stays under the token budget; ``prefetched`` draws the
same batches in a helper process (GPU training, where the host is the bottleneck).

Besides the K3-format tasks the warm-up can hold ``induce`` samples: raw token sequences, not chats
(``filler, s, w_1..w_n, s, w_1..w_n``, loss on the second copy), which teach content-addressed copying,
and ``assoc`` samples (``assoc_sample``: many keyed values, then many of the keys asked back), meant to
teach finding a value by its key in contexts as long as the recall lists.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from training import pools, sessions, tasks
from training.render import encode_sample, encode_turns
from training.vocab import CompactVocab

# "session" (sessions.py: several requests over one tool set, every answer learnt) is off unless a mix asks for it
MIX = {"tool": 0.18, "choose": 0.2, "decline": 0.18, "json": 0.17, "recall": 0.18, "followup": 0.12, "session": 0.0}
SHORT, LONG = (4, 16), (110, 175)
RAMP = (0.3, 0.75)  # recall lists grow from SHORT to LONG between these fractions of the steps
RECALL_REF = 40  # recall keeps its full MIX weight up to this many records on average
SPECIAL_BASE = 163584  # the Kimi vocabulary's reserved/special ids start here
STRICT_SHARE = 0.5  # samples whose tools are declared strict (rendered as such; clients send both kinds)


@dataclass(frozen=True)
class Encoded:
    kind: str
    ids: list[int]
    n_prompt: int
    spans: tuple[tuple[int, int], ...] = ()  # the answers' [start, end) when there are several (sessions)

    @property
    def answers(self) -> tuple[tuple[int, int], ...]:
        """The [start, end) spans with loss: every assistant message, or just what follows the prompt."""
        return self.spans or ((self.n_prompt, len(self.ids)),)

    @property
    def n_answer(self) -> int:
        return sum(end - start for start, end in self.answers)


def recall_range(progress: float) -> tuple[int, int]:
    t = min(1.0, max(0.0, (progress - RAMP[0]) / (RAMP[1] - RAMP[0])))
    return round(SHORT[0] + t * (LONG[0] - SHORT[0])), round(SHORT[1] + t * (LONG[1] - SHORT[1]))


def ramp_done(progress: float) -> float:
    """How far (0-1) the recall ramp has got by ``progress``, counted from the start of training: what the
    synthetic samples that lengthen with the recall lists use."""
    return min(1.0, max(0.0, progress / RAMP[1]))


def recall_weight(progress: float, base: float = MIX["recall"]) -> float:
    """Mix weight of recall (``base`` for short lists): constant token share once lists are longer than
    ``RECALL_REF`` records."""
    lo, hi = recall_range(progress)
    return base * min(1.0, RECALL_REF / ((lo + hi) / 2))


def parse_mix(text: str) -> dict[str, float]:
    """``MIX`` with some weights replaced: ``"recall=0,choose=0.3"`` ("" keeps ``MIX``). Weights are
    relative (they need not sum to 1); at least one must stay positive."""
    mix = dict(MIX)
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, eq, value = (x.strip() for x in part.partition("="))
        if not eq or kind not in MIX:
            raise ValueError(f"task mix entries are kind=weight with kind one of {', '.join(MIX)}; got {part!r}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"task mix weight of {kind!r} is not a number: {value!r}") from None
        if not (math.isfinite(weight) and weight >= 0.0):
            raise ValueError(f"task mix weight of {kind!r} must be finite and >= 0, got {value!r}")
        mix[kind] = weight
    if not any(mix.values()):
        raise ValueError("task mix: at least one weight must be positive")
    return mix


@dataclass(frozen=True)
class CopyWarmup:
    """Share of warm-up samples: ``share`` until ``until`` (fraction of steps), ``after`` from then on; a
    ``lookup`` fraction of them are key -> value lookups, a ``recall`` fraction recall lists as long as the
    curriculum has them then, an ``induce`` fraction synthetic token copies (``induce_sample``), the rest
    plain copies. Before ``induce_until`` every sample is a synthetic copy. An ``assoc`` fraction of the
    synthetic samples are associative recall (``assoc_sample``) rather than copies; with ``induce_long``
    the copies lengthen with the recall lists up to that many tokens (``induce_items``). A ``lookup_objects``
    fraction of the lookups ask keys in quotes and are answered as an object (``tasks.make_lookup``). Tool and
    choose requests have 1 to ``tool_leaves`` argument leaves (``tasks.TOOL_LEAVES`` in evaluations); when that
    is not the default, so have declines (evaluations: ``tasks.DECLINE_LEAVES``). A ``decline_object`` fraction
    of the declines ask for a tool that shares its object with an offered one (``tasks.make_decline``), a
    ``choose_object`` fraction of the choices offer such a tool beside the picked one (``tasks.make_choose``),
    both from curriculum progress ``hard_from`` on (0: throughout). An ``array_repeats`` fraction of the array
    values in tool, choose and JSON requests write one word twice, an ``array_twins`` fraction of those as the
    last two words (``tasks._words``)."""
    share: float = 0.0
    until: float = 0.0
    after: float = 0.0
    lookup: float = 0.0
    recall: float = 0.0
    induce: float = 0.0
    induce_until: float = 0.0
    assoc: float = 0.0
    induce_long: int = 0
    lookup_objects: float = 0.0
    tool_leaves: int = tasks.TOOL_LEAVES
    decline_object: float = 0.0
    choose_object: float = 0.0
    hard_from: float = 0.0
    array_repeats: float = 0.0
    array_twins: float = 0.0

    def __post_init__(self) -> None:
        for name in ("share", "until", "after", "lookup", "recall", "induce", "induce_until", "assoc",
                     "lookup_objects", "decline_object", "choose_object", "hard_from", "array_repeats",
                     "array_twins"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"copy warm-up {name} must be in [0, 1]")
        if self.induce_long < 0:
            raise ValueError("copy warm-up induce_long must be >= 0")
        if self.tool_leaves < 1:
            raise ValueError("tool_leaves must be >= 1")
        if self.lookup + self.recall + self.induce > 1.0:
            raise ValueError("copy warm-up lookup + recall + induce fractions must be at most 1")

    def at(self, progress: float) -> float:
        return self.share if progress < self.until else self.after


def sample_kind(rng: random.Random, copy_share: float = 0.0, lookup: float = 0.0, recall: float = 0.0,
                progress: float = 0.0, induce: float = 0.0, mix: dict[str, float] = MIX) -> str:
    if copy_share and rng.random() < copy_share:
        r = rng.random()
        return ("lookup" if r < lookup else "recall" if r < lookup + recall
                else "induce" if r < lookup + recall + induce else "copy")
    weights = [recall_weight(progress, w) if k == "recall" else w for k, w in mix.items()]
    return rng.choices(list(mix), weights=weights)[0]


# Warm-up samples are short and without a system prompt: on the real format, copying formed within ~400
# steps at 12 items and ~40-token prompts, and not within 400 steps at 24 items with the ~60-token
# thinking-effort system message in front (softmax attention without positions spreads over every earlier
# token, so a longer context delays the induction it has to find).
WARMUP = {"copy": {"thinking": False, "items": (3, 12)}, "lookup": {"thinking": False},
          "recall": {"thinking": False}}


INDUCE_FILLER, INDUCE_ITEMS = 120, (4, 24)


def induce_items(progress: float, longest: int = 0) -> tuple[int, int]:
    """Range of copied tokens in an ``induce`` sample: ``INDUCE_ITEMS`` at first, growing with the recall
    lists to ``longest`` by the end of their ramp (0: no growth). Copying by content has to pick one earlier token
    out of all of them, and what is learnt on short copies does not carry over to lists of dozens of records."""
    lo, hi = INDUCE_ITEMS
    if longest <= hi:
        return lo, hi
    return lo, round(hi + ramp_done(progress) * (longest - hi))


def induce_sample(rng: random.Random, pool: Sequence[int], items: tuple[int, int] = INDUCE_ITEMS) -> Encoded:
    """``filler, s, w_1..w_n, s, w_1..w_n`` over ``pool`` (full-vocabulary ids, no specials), n drawn from
    ``items``: the answer is the second copy, including its first token (found through the separator
    ``s``, itself a random token). The ``w`` and ``s`` are distinct and the filler holds none of them, so
    the token after an earlier occurrence of the current one is always the right next token: the model
    can only copy by content. On the copy probe (k3-default body, one core, 2,048 tokens a step, filler
    0-60) such copying reached 92% teacher-forced accuracy in 300 steps."""
    picked = rng.sample(pool, rng.randint(*items) + 1)
    sep, words = picked[0], picked[1:]
    filler = [t for t in rng.choices(pool, k=rng.randint(0, INDUCE_FILLER)) if t not in picked]
    prompt = [*filler, sep, *words, sep]
    return Encoded("induce", prompt + words, len(prompt))


ASSOC_PAIRS = (4, 160)  # keyed values per sample: ~1.9k tokens at the top, as long as the longest recall
ASSOC_GLUE = 3  # up to this many fixed tokens between a key and its value ("Record 290: \"" has two)


def assoc_pairs(progress: float) -> tuple[int, int]:
    """Range of keyed values in an ``assoc`` sample: short at first, as long as recall lists by the end of
    the recall ramp (induction over a long context does not form from scratch: measured on the copy
    probe, filler of up to 1,000 tokens kept it from forming within 200 steps)."""
    lo, hi = ASSOC_PAIRS
    return lo, round(2 * lo + ramp_done(progress) * (hi - 2 * lo))


def assoc_sample(rng: random.Random, pool: Sequence[int], pairs: int) -> Encoded:
    """Multi-query associative recall over ``pool``: ``pairs`` records ``k, g.., v_1..v_n, e`` (n in 1-8),
    a marker ``q``, then half of the keys in random order, each followed by its record again; the answer
    is everything after ``q``. Glue ``g`` (0-3 fixed tokens) and ``e`` are the same in every record and
    all tokens are distinct, so each value is found by its key alone, at a fixed offset after it, and its
    later tokens by content. This is what a recall list asks for (the record number three tokens before
    the passage) and what a tool argument asks for (the key a few tokens before the value), with a
    supervised token for about every third token of the sequence instead of ~1% in a recall sample."""
    lens = [rng.randint(1, 8) for _ in range(pairs)]
    glue_n = rng.randint(0, ASSOC_GLUE)
    picked = rng.sample(pool, pairs + sum(lens) + glue_n + 2)
    q, e, glue = picked[0], picked[1], picked[2:2 + glue_n]
    rest = iter(picked[2 + glue_n:])
    records = [[next(rest), *glue, *(next(rest) for _ in range(n)), e] for n in lens]
    prompt = [t for r in records for t in r] + [q]
    asked = rng.sample(records, max(1, pairs // 2))
    return Encoded("assoc", prompt + [t for r in asked for t in r], len(prompt))


# Earlier exchanges put in front of a sample (``history``): short tasks answered in content only.
HISTORY_KINDS = ("copy", "lookup", "json")


def with_history(rng: random.Random, s: tasks.Sample, turns: int, style: tasks.Style = tasks.PLAIN) -> tasks.Sample:
    """``s`` after ``turns`` earlier user/assistant exchanges. A model trained only on tasks that open the
    conversation can find what to copy by where it sits; with history in front only the content can tell."""
    prev: list[dict] = []
    for _ in range(turns):
        h = tasks.make(rng.choice(HISTORY_KINDS), rng, held_out=False, thinking=False, style=style)
        prev += [*h.messages, {"role": "assistant", "content": h.target["content"]}]
    return replace(s, messages=prev + s.messages)


def draw(rng: random.Random, tokenizer, progress: float, warmup: CopyWarmup = CopyWarmup(),
         history: float = 0.0, pool: Sequence[int] = (), mix: dict[str, float] = MIX,
         style: tasks.Style = tasks.PLAIN) -> Encoded:
    """One encoded sample, of a kind drawn from ``mix`` outside the warm-up; a ``history`` fraction of them
    (not recall lists) after 1-3 earlier exchanges (no random draw for it when 0, so runs without it draw
    exactly what they drew before). ``induce`` samples draw their tokens from ``pool``; the tasks are
    written in ``style``."""
    if progress < warmup.induce_until:
        kind = "induce"
    else:
        kind = sample_kind(rng, warmup.at(progress), warmup.lookup, warmup.recall, progress, warmup.induce, mix)
    if kind == "induce":
        if not pool:
            raise ValueError("induce samples need a token pool")
        if warmup.assoc and rng.random() < warmup.assoc:
            return assoc_sample(rng, pool, rng.randint(*assoc_pairs(progress)))
        return induce_sample(rng, pool, induce_items(progress, warmup.induce_long))
    kwargs = {"records": rng.randint(*recall_range(progress))} if kind == "recall" else {}
    if kind == "lookup" and warmup.lookup_objects:
        kwargs["objects"] = warmup.lookup_objects
    if kind in ("tool", "choose", "decline") and warmup.tool_leaves != tasks.TOOL_LEAVES:
        # declines too (else how many values a request lists tells them apart); only when widened, so that a
        # default run keeps declines at tasks.DECLINE_LEAVES and draws what it drew before
        kwargs["leaves"] = warmup.tool_leaves
    # only when set, so a default run draws what it drew before
    object_share = {"decline": warmup.decline_object, "choose": warmup.choose_object}.get(kind)
    if object_share and progress >= warmup.hard_from:
        kwargs["object_share"] = object_share
    if warmup.array_repeats and kind in ("tool", "choose", "json"):  # the kinds that copy values into an answer
        kwargs["repeats"] = warmup.array_repeats
        if warmup.array_twins:
            kwargs["twins"] = warmup.array_twins
    if kind in WARMUP and progress < warmup.until:
        kwargs |= WARMUP[kind]
    s = sessions.make(rng, style=style) if kind == "session" else tasks.make(kind, rng, style=style, **kwargs)
    if s.tools and rng.random() < STRICT_SHARE:
        s = tasks.strict(s)
    if kind == "session":  # a session brings its own history, and every answer in it is learnt
        return Encoded(kind, *encode_turns(s, tokenizer))
    if history and kind != "recall" and rng.random() < history:
        s = with_history(rng, s, rng.randint(1, 3), style)
    ids, n = encode_sample(s, tokenizer)
    return Encoded(kind, ids, n)


def inventory(tokenizer, seed: int, per_kind: int = 600, style: tasks.Style = tasks.PLAIN) -> set[int]:
    """The used ids: the lexicon and number pieces, plus every id of ``per_kind`` training-side samples of
    each kind (short recall lists; length does not add ids), written in ``style``. Samples drawn later that
    fall outside are skipped by ``batches``."""
    rng = random.Random(seed)
    # Every lexicon word in both forms and every number piece, so rare draws are never skipped.
    used: set[int] = {int(i) for w in pools.LEXICON for i in (*tokenizer.encode(w), *tokenizer.encode(" " + w))}
    used.update(int(i) for n in range(1000) for i in tokenizer.encode(str(n)))
    for kind in (*tasks.KINDS, *tasks.WARMUP_KINDS):
        for _ in range(per_kind):
            kwargs = {"records": 20} if kind == "recall" else {}
            s = tasks.make(kind, rng, held_out=False, style=style, **kwargs)
            for variant in (s, tasks.strict(s)) if s.tools else (s,):
                used.update(encode_sample(variant, tokenizer)[0])
    return used


def token_pool(vocab: CompactVocab) -> list[int]:
    """The used ids that are ordinary tokens (not the chat markup's specials): what ``induce`` samples use."""
    return [i for i in vocab.ids if i < SPECIAL_BASE]


def batches(tokenizer, vocab: CompactVocab, *, seed: int, steps: int, tokens_per_step: int,
            stats: dict[str, int] | None = None, warmup: CopyWarmup = CopyWarmup(),
            progress_from: float = 0.0, history: float = 0.0, mix: dict[str, float] = MIX,
            style: tasks.Style = tasks.PLAIN, lookahead: float = 0.0) -> Iterator[list[Encoded]]:
    """``steps`` batches of fresh samples, deterministic in ``seed``; never cut a sample. The curriculum runs
    from ``progress_from`` to 1 over the steps (a run that continues another starts where that one ended).

    ``lookahead == 0``: samples in the order drawn, a batch closed by the first one that does not fit (it opens
    the next). ``lookahead == K``: ``pack`` from a pool of drawn samples topped up to K batches' tokens, so
    batches come out nearly full and of nearly equal length, and data-parallel ranks wait less for each other
    at the all-reduce (at the final mix the two ranks' batches differ by ~100 tokens at K = 3, ~320 without)."""
    rng = random.Random(seed)
    pool = token_pool(vocab) if warmup.induce or warmup.induce_until else []

    def fresh(step: int) -> Encoded:
        while True:
            e = draw(rng, tokenizer, progress_from + (1.0 - progress_from) * step / steps, warmup, history, pool,
                     mix, style)
            if vocab.covers(e.ids):
                return e
            if stats is not None:
                stats["skipped"] = stats.get("skipped", 0) + 1

    if lookahead:
        waiting: list[Encoded] = []
        for step in range(steps):
            while sum(len(e.ids) for e in waiting) < lookahead * tokens_per_step:
                waiting.append(fresh(step))
            yield pack(waiting, tokens_per_step)
        return
    pending: Encoded | None = None
    for step in range(steps):
        batch: list[Encoded] = []
        used = 0
        while True:
            e = pending or fresh(step)
            pending = None
            if batch and used + len(e.ids) > tokens_per_step:
                pending = e
                break
            batch.append(e)
            used += len(e.ids)
        yield batch


def pack(waiting: list[Encoded], budget: int) -> list[Encoded]:
    """Take one batch out of ``waiting`` (oldest first), in place: the oldest sample, then each later one, in
    order, that still fits in ``budget`` tokens. The oldest always goes, so no sample waits more than
    ``len(waiting)`` batches and the task mix is the drawn one; the later ones fill the gap it leaves."""
    batch, used, keep = [waiting[0]], len(waiting[0].ids), []
    for e in waiting[1:]:
        if used + len(e.ids) <= budget:
            batch.append(e)
            used += len(e.ids)
        else:
            keep.append(e)
    waiting[:] = keep
    return batch


def _produce(queue, vocab_ids: list[int], full_size: int, kwargs: dict) -> None:
    from training.tok import load_tokenizer

    stats: dict[str, int] = {}
    for batch in batches(load_tokenizer(), CompactVocab(vocab_ids, full_size), stats=stats, **kwargs):
        queue.put((batch, dict(stats)))
    queue.put(None)


def prefetched(tokenizer, vocab: CompactVocab, *, seed: int, steps: int, tokens_per_step: int,
               stats: dict[str, int] | None = None, warmup: CopyWarmup = CopyWarmup(),
               progress_from: float = 0.0, history: float = 0.0, mix: dict[str, float] = MIX,
               style: tasks.Style = tasks.PLAIN, lookahead: float = 0.0, depth: int = 16) -> Iterator[list[Encoded]]:
    """``batches`` drawn in a helper process, up to ``depth`` ahead: the same batches in the same order.
    ``tokenizer`` is unused (the helper loads its own: the native one does not cross processes)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue(maxsize=depth)
    kwargs = {"seed": seed, "steps": steps, "tokens_per_step": tokens_per_step, "warmup": warmup,
              "progress_from": progress_from, "history": history, "mix": mix, "style": style, "lookahead": lookahead}
    proc = ctx.Process(target=_produce, args=(queue, vocab.ids, vocab.full_size, kwargs), daemon=True)
    proc.start()
    try:
        while (item := queue.get()) is not None:
            batch, seen = item
            if stats is not None:
                stats.update(seen)
            yield batch
    finally:
        proc.kill()
        proc.join()
