"""Closed word pools for the synthetic K3 data, and the train / held-out split of composed names.

Every string the generator emits is built from these pools (plus digits and the chat format's own
text), so the token ids the data uses form a small fixed set: the trained rows of the embedding.
Held-out tasks use *new combinations* (tool names, schemas, values) of the same pieces, never new
pieces: a token the model never saw has an untrained (zero) row and could not be copied.

A composed name is held out when ``crc32(name) % HOLDOUT_MOD == 0``; training never draws those.

``LEXICON`` (1,600 words, ``lexicon.txt``) feeds recall passages, copy samples and string values: a
passage drawn without repetition from it has every word once, so each word of it names one place to copy
from; with the 100-word ``WORDS`` pool a 1,200-word recall list repeated every word about 12 times.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path

HOLDOUT_MOD = 4

VERBS = ("get", "set", "find", "list", "create", "delete", "update", "check", "send", "book", "cancel",
         "search", "count", "move", "copy", "open", "close", "start", "stop", "rename", "share", "track",
         "order", "measure", "schedule", "fetch", "translate", "convert", "reserve", "scan")
OBJECTS = ("weather", "ticket", "flight", "hotel", "order", "invoice", "user", "file", "folder", "email",
           "message", "event", "meeting", "task", "note", "song", "playlist", "photo", "album", "device",
           "sensor", "report", "account", "payment", "package", "recipe", "table", "room", "car", "train",
           "book", "movie", "stock", "price", "river", "city", "road", "garden", "lamp", "door")
KEYS = ("city", "country", "name", "title", "date", "time", "count", "limit", "price", "color", "size",
        "label", "owner", "status", "level", "speed", "weight", "height", "width", "depth", "code", "unit",
        "language", "format", "mode", "priority", "amount", "currency", "street", "zip", "floor", "seat",
        "genre", "artist", "year", "month", "day", "hour", "minute", "room", "guests", "nights", "query",
        "tag", "category", "source", "target", "reason", "comment", "channel")
WORDS = ("apple", "river", "stone", "cloud", "green", "blue", "red", "silver", "gold", "north", "south",
         "east", "west", "winter", "summer", "spring", "autumn", "morning", "evening", "night", "light",
         "dark", "quiet", "loud", "fast", "slow", "happy", "small", "large", "bright", "ocean", "forest",
         "mountain", "valley", "island", "bridge", "tower", "castle", "garden", "market", "station", "harbor",
         "window", "paper", "pencil", "music", "piano", "guitar", "violin", "coffee", "tea", "bread", "cheese",
         "orange", "lemon", "cherry", "tiger", "eagle", "wolf", "horse", "rabbit", "falcon", "dragon", "star",
         "moon", "sun", "planet", "rocket", "engine", "wheel", "anchor", "shadow", "echo", "signal", "pixel",
         "marble", "velvet", "copper", "iron", "crystal", "maple", "cedar", "willow", "lotus", "tulip",
         "rose", "meadow", "desert", "canyon", "glacier", "thunder", "breeze", "storm", "rain", "snow")
NAMES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Vienna",
         "Prague", "Dublin", "Boston", "Denver", "Austin", "Seattle", "Chicago", "Toronto", "Sydney",
         "Mumbai", "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Iris", "Jack",
         "Kate", "Leo", "Maria", "Noah", "Olivia", "Peter", "Quinn", "Ruth", "Sam", "Tina")
LEXICON = tuple(w for w in (Path(__file__).with_name("lexicon.txt").read_text().split("\n"))
                if w and not w.startswith("#"))
ENUMS = (("low", "medium", "high"), ("small", "medium", "large"), ("red", "green", "blue"),
         ("daily", "weekly", "monthly"), ("open", "closed", "pending"), ("metric", "imperial"),
         ("json", "text", "table"), ("north", "south", "east", "west"))


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HOLDOUT_MOD == 0


def tool_name(rng: random.Random, held_out: bool) -> tuple[str, str, str]:
    """(name, verb, object) for a tool on the requested side of the split.

    Names are ``verb_object``. A random suffix (``_info``, ``_list``...) was tried: the model had to copy
    it from the declarations by matching verb and object at once, and a 1.2 M-parameter body got the
    suffix wrong in half of the tool calls."""
    while True:
        verb, obj = rng.choice(VERBS), rng.choice(OBJECTS)
        name = f"{verb}_{obj}"
        if is_held_out(name) == held_out:
            return name, verb, obj


def phrase(rng: random.Random, lo: int = 1, hi: int = 2) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def string_value(rng: random.Random) -> str:
    r = rng.random()
    return rng.choice(NAMES) if r < 0.3 else phrase(rng) if r < 0.6 else " ".join(
        rng.sample(LEXICON, rng.randint(1, 2)))


def passage(rng: random.Random, n: int, used: set[str]) -> list[str]:
    """``n`` lexicon words not in ``used`` (which grows): no word repeats within one document."""
    out: list[str] = []
    while len(out) < n:
        w = rng.choice(LEXICON)
        if w not in used:
            used.add(w)
            out.append(w)
    return out
