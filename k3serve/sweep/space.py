"""The search space: named options of ``k3serve serve``, a grid over them, and each point's launch command.

``--grid NAME=V1,V2`` gives an option its values; the grid is the cross product of every option's values,
for every model of ``--models``. Each option renders to ``k3serve serve`` flags, so a point's launch command
is exactly what the sweep ran (tests/sweep parses it back through the serve CLI's own parser).

    model names       the positional MODEL of ``k3serve serve``
    Point             one configuration: model + (option, value) pairs in option order; ``key`` names it
                      (the resume key in points.jsonl)

"Chunk size" is ``max_num_batched_tokens`` here: the scheduler cuts prefills to the step's token budget.
The KDA snapshot interval is ``state_cache_interval``; the router's policy and weights (``router_*``) apply to
``replicas`` > 1, the router that ``k3serve serve --replicas`` puts in front.
"""

from __future__ import annotations

import itertools
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_MODELS = ("kimi-linear-tiny-random", "k3-default")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("expected an integer") from None
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "1", "yes"):
        return True
    if text.lower() in ("off", "false", "0", "no"):
        return False
    raise ValueError("expected on or off")


def _interval(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("expected an integer") from None
    if value < 0 or value % 16:
        raise ValueError("must be a non-negative multiple of the 16-token block")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number") from None
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _policy(text: str) -> str:
    from k3serve.router.policy import POLICIES

    if text not in POLICIES:
        raise ValueError(f"one of {', '.join(POLICIES)}")
    return text


def _speculative(text: str) -> str:
    """``off`` | ``ngram:K`` | ``suffix:K`` (K draft tokens), checked by the engine's own parser."""
    if text == "off":
        return text
    method, _, k = text.partition(":")
    _positive_int(k)
    from k3serve.engine.spec.config import SpeculativeConfig

    SpeculativeConfig.parse(json.dumps({"method": method, "num_speculative_tokens": int(k)}))
    return text


def _spec_flags(value: str) -> list[str]:
    if value == "off":
        return []
    method, _, k = value.partition(":")
    return ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": int(k)},
                                                separators=(",", ":"))]


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[str], object]  # text -> value (ValueError with the reason)
    flags: Callable[[object], list[str]]  # value -> serve flags ([] for serve's default)
    help: str


def _int_flag(flag: str, default: int) -> Callable[[object], list[str]]:
    return lambda v: [] if v == default else [flag, str(v)]


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("max_num_batched_tokens", _positive_int, _int_flag("--max-num-batched-tokens", 2048),
           "token budget of a step (= the prefill chunk size)"),
    Option("max_num_seqs", _positive_int, _int_flag("--max-num-seqs", 64), "requests running at once"),
    Option("enable_prefix_caching", _on_off, lambda v: [] if v else ["--no-enable-prefix-caching"],
           "on | off"),
    Option("speculative", _speculative, _spec_flags, "off | ngram:K | suffix:K (K draft tokens)"),
    Option("tensor_parallel_size", _positive_int, _int_flag("--tensor-parallel-size", 1), "ranks of one engine"),
    Option("data_parallel_size", _positive_int, _int_flag("--data-parallel-size", 1), "engines behind one server"),
    Option("enable_expert_parallel", _on_off, lambda v: ["--enable-expert-parallel"] if v else [],
           "on | off (whole experts per tp rank)"),
    Option("replicas", _positive_int, _int_flag("--replicas", 1), "servers behind the KV-aware router"),
    Option("kv_cache_memory", str, lambda v: ["--kv-cache-memory", str(v)], "KV/state cache bytes, e.g. 512MiB"),
    Option("state_cache_interval", _interval, _int_flag("--state-cache-interval", 0),
           "extra KDA snapshots every N prompt tokens (0: prompt ends only)"),
    Option("router_policy", _policy, lambda v: [] if v == "kv" else ["--router-policy", str(v)],
           "the --replicas router's policy: kv | round_robin | least_load | session"),
    Option("router_weight", _positive_float, lambda v: ["--router-weight", str(v)],
           "kv router: cost per prefill block relative to a decode block"),
    Option("router_cache_weight", _positive_float, lambda v: ["--router-cache-weight", str(v)],
           "kv router: cost per block newly written into a replica's cache"),
)}

# serve's defaults first, so the default configuration is always a point of the default grid
DEFAULT_GRID: dict[str, tuple[str, ...]] = {
    "max_num_batched_tokens": ("2048", "256"),
    "max_num_seqs": ("64", "2"),
    "enable_prefix_caching": ("on", "off"),
}


@dataclass(frozen=True)
class Point:
    model: str
    settings: tuple[tuple[str, object], ...]  # (option name, parsed value), in option order

    @property
    def key(self) -> str:
        return self.model + "".join(f" {name}={_text(v)}" for name, v in self.settings)

    def serve_args(self) -> list[str]:
        """``k3serve serve`` arguments after the command (model first), without --host/--port."""
        out = [self.model]
        for name, value in self.settings:
            out += OPTIONS[name].flags(value)
        return out

    def command(self, extra: Sequence[str] = ()) -> str:
        return shlex.join(["k3serve", "serve", *self.serve_args(), *extra])


def _text(v: object) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def parse_grid(items: Sequence[str]) -> dict[str, tuple[object, ...]]:
    """``["max_num_seqs=2,64", ...]`` -> {option: values}; unknown names, bad or repeated values are one
    ValueError naming the item."""
    grid: dict[str, tuple[object, ...]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ValueError(f"--grid {item!r}: expected NAME=V1,V2,...")
        if name not in OPTIONS:
            raise ValueError(f"--grid {item!r}: unknown option {name!r}; known: {', '.join(OPTIONS)}")
        if name in grid:
            raise ValueError(f"--grid {item!r}: {name} given twice")
        parsed = []
        for text in (v.strip() for v in values.split(",")):
            try:
                parsed.append(OPTIONS[name].parse(text))
            except (ValueError, TypeError) as e:
                raise ValueError(f"--grid {item!r}: bad value {text!r} ({e})") from None
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"--grid {item!r}: repeated value")
        grid[name] = tuple(parsed)
    return grid


def default_grid() -> dict[str, tuple[object, ...]]:
    return parse_grid([f"{k}={','.join(v)}" for k, v in DEFAULT_GRID.items()])


def expand(models: Sequence[str], grid: dict[str, tuple[object, ...]]) -> list[Point]:
    """Every model x every combination, options in OPTIONS order (so a point's key does not depend on the
    order of the --grid flags); the first values of each option come first."""
    if not models:
        raise ValueError("--models: give at least one model")
    if len(set(models)) != len(models):
        raise ValueError("--models: a model is given twice")
    routed = [n for n in grid if n.startswith("router_")]
    if routed and not all(isinstance(r, int) and r > 1 for r in grid.get("replicas", (1,))):
        raise ValueError(f"--grid {routed[0]}: the router options need --grid replicas=N with every N > 1")
    names = [n for n in OPTIONS if n in grid]
    combos = list(itertools.product(*(grid[n] for n in names)))
    return [Point(m, tuple(zip(names, c))) for m in models for c in combos]


def default_point(model: str) -> Point:
    """The configuration ``k3serve serve MODEL`` runs with no option given."""
    return Point(model, ())


def is_default(p: Point) -> bool:
    return p.serve_args() == [p.model]
