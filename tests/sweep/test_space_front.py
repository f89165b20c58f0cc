"""``k3serve sweep`` without servers: grid parsing, launch commands through the serve CLI's own parser, the
Pareto front and SLO filtering on synthetic points, modelled points, and bad input as one line."""

from __future__ import annotations

import argparse
import shlex

import pytest

from k3serve.cli import main
from k3serve.sweep.front import SLO, eligible, fronts, pareto_front
from k3serve.sweep.modelled import modelled_points, parse_modelled
from k3serve.sweep.space import Point, default_grid, expand, is_default, parse_grid


def test_grid_parses_values_and_expands_per_model_in_option_order():
    grid = parse_grid(["enable-prefix-caching=on,off", "max_num_seqs=2,64"])
    assert grid == {"enable_prefix_caching": (True, False), "max_num_seqs": (2, 64)}
    points = expand(["a", "b"], grid)
    assert len(points) == 8 and [p.model for p in points] == ["a"] * 4 + ["b"] * 4
    # option order, not flag order: the key (the resume key) does not depend on how the flags were given
    assert points[0].key == "a max_num_seqs=2 enable_prefix_caching=on"
    assert len({p.key for p in points}) == 8
    assert expand(["a"], {}) == [Point("a", ())]


def test_default_grid_holds_the_default_configuration():
    points = expand(["m"], default_grid())
    assert len(points) == 8 and sum(is_default(p) for p in points) == 1 and is_default(points[0])


@pytest.mark.parametrize("item, message", [
    ("max_num_seqs", "expected NAME=V1,V2"),
    ("max_num_seqs=", "expected NAME=V1,V2"),
    ("chunk=1,2", "unknown option 'chunk'"),
    ("max_num_seqs=0", "bad value '0'"),
    ("max_num_seqs=x", "expected an integer"),
    ("max_num_seqs=2,2", "repeated value"),
    ("enable_prefix_caching=maybe", "expected on or off"),
    ("speculative=ngram", "bad value 'ngram'"),
    ("speculative=eagle:3", "unknown method"),
    ("state_cache_interval=24", "multiple of the 16-token block"),
    ("router_policy=random", "one of kv"),
    ("router_weight=0", "must be > 0"),
])
def test_bad_grid_items_are_one_clear_error(item, message):
    with pytest.raises(ValueError, match=message):
        parse_grid([item])
    with pytest.raises(ValueError, match="given twice"):
        parse_grid(["max_num_seqs=1", "max_num_seqs=2"])


def test_router_options_need_replicas():
    with pytest.raises(ValueError, match="router_policy: the router options need --grid replicas"):
        expand(["k3-default"], parse_grid(["router_policy=kv,least_load"]))
    with pytest.raises(ValueError, match="every N > 1"):
        expand(["k3-default"], parse_grid(["router_weight=1.5", "replicas=1,2"]))
    assert len(expand(["k3-default"], parse_grid(["router_policy=kv,least_load", "replicas=2"]))) == 2


def _serve_parser() -> argparse.ArgumentParser:
    from k3serve.entrypoints.serve_cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_launch_commands_round_trip_through_the_serve_parser():
    grid = parse_grid(["max_num_batched_tokens=256,2048", "max_num_seqs=3", "enable_prefix_caching=off,on",
                       "speculative=off,ngram:4", "tensor_parallel_size=2", "enable_expert_parallel=on",
                       "replicas=1,2", "kv_cache_memory=512MiB"])
    parser = _serve_parser()
    for pt in expand(["k3-default", "/some dir/ckpt"], grid):
        argv = shlex.split(pt.command())
        assert argv[:2] == ["k3serve", "serve"]
        args = parser.parse_args(argv[2:])
        s = dict(pt.settings)
        assert args.model == pt.model
        assert (args.max_num_batched_tokens, args.max_num_seqs) == (s["max_num_batched_tokens"], 3)
        assert args.prefix_caching is s["enable_prefix_caching"]
        assert args.tensor_parallel_size == 2 and args.enable_expert_parallel and args.replicas == s["replicas"]
        assert args.kv_cache_memory == 512 << 20
        if s["speculative"] == "off":
            assert args.speculative_config is None
        else:
            from k3serve.engine.spec.config import SpeculativeConfig

            spec = SpeculativeConfig.parse(args.speculative_config)
            assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)
    grid = parse_grid(["state_cache_interval=0,32", "router_policy=kv,round_robin", "router_weight=1.5",
                       "router_cache_weight=4", "replicas=2"])
    for pt in expand(["k3-default"], grid):
        args, s = parser.parse_args(shlex.split(pt.command())[2:]), dict(pt.settings)
        assert (args.state_cache_interval, args.router_policy) == (s["state_cache_interval"], s["router_policy"])
        assert (args.router_weight, args.router_cache_weight, args.replicas) == (1.5, 4.0, 2)
    # the default configuration is the bare command
    assert Point("k3-default", ()).command() == "k3serve serve k3-default"


def _pt(key, tput, lat, **kw):
    return {"key": key, "status": "ok", "failed": 0, "output_throughput": tput, "p99_tpot_ms": lat,
            "p99_ttft_ms": kw.pop("ttft", 100.0), **kw}


def test_pareto_front_keeps_ties_and_drops_dominated_points():
    pts = [_pt("a", 10, 100), _pt("b", 20, 200), _pt("c", 15, 250),  # c: b has more and is faster
           _pt("d", 20, 200), _pt("e", 10, 150), _pt("f", 30, 400), _pt("g", 30, 300)]  # e by a, f by g
    front = pareto_front(pts, "output_throughput", "p99_tpot_ms")
    assert [p["key"] for p in front] == ["a", "b", "d", "g"]  # b and d tie: neither dominates the other
    assert pareto_front([], "output_throughput", "p99_tpot_ms") == []


def test_slo_filters_before_the_front_and_failed_points_never_count():
    pts = [_pt("fast", 10, 50, ttft=100), _pt("slow-ttft", 50, 40, ttft=5000),
           _pt("some-failed", 80, 10, failed=1), {"key": "down", "status": "failed", "error": "x"},
           _pt("modelled", 1000, 5, modelled=True)]
    slo = SLO((("p99_ttft_ms", 1000.0),))
    f = fronts(pts, slo, "output_throughput", "p99_tpot_ms")
    assert [p["key"] for p in f["measured"]] == ["fast"]  # slow-ttft dominates it but misses the SLO
    assert [p["key"] for p in f["modelled"]] == ["modelled"]
    no_slo = fronts(pts, SLO(), "output_throughput", "p99_tpot_ms")
    assert [p["key"] for p in no_slo["measured"]] == ["slow-ttft"]
    assert not eligible(pts[3], SLO(), "output_throughput", "p99_tpot_ms")
    with pytest.raises(ValueError, match="> 0 ms"):
        SLO((("p99_ttft_ms", 0.0),))


def test_modelled_points_come_from_the_planner_and_are_marked():
    pts = modelled_points(parse_modelled(["GB300:8"]), 8192, (99,))
    assert pts and all(p["modelled"] and p["gpu"] == "GB300" and p["gpus"] == 8 for p in pts)
    tp8 = [p for p in pts if p["layout"] == "tp8pp1dp1ep8"]
    assert tp8 and all(p["command"].startswith("k3serve serve moonshotai/Kimi-K3") for p in tp8)
    assert all(p["k3serve_not_yet_supported"] == [] for p in tp8)
    # more concurrency: more modelled throughput, slower steps
    by_conc = sorted(tp8, key=lambda p: p["concurrency"])
    assert by_conc[0]["concurrency"] == 1 and by_conc[-1]["output_throughput"] > by_conc[0]["output_throughput"]
    assert by_conc[-1]["p99_tpot_ms"] > by_conc[0]["p99_tpot_ms"]
    with pytest.raises(ValueError, match="does not fit"):
        modelled_points(parse_modelled(["H100:1"]), 8192, (99,))


@pytest.mark.parametrize("argv, message", [
    (["--grid", "nope=1"], "unknown option 'nope'"),
    (["--latency", "p99_foo_ms"], "--latency 'p99_foo_ms'"),
    (["--slo", "p99_ttft_ms"], "--slo 'p99_ttft_ms'"),
    (["--slo-ttft-p99-ms", "-5"], "must be > 0 ms"),
    (["--modelled", "B999:8"], "unknown GPU 'B999'"),
    (["--modelled", "GB300"], "expected GPU:N"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--point-timeout", "0"], "--point-timeout must be > 0"),
    (["--models", "a", "a"], "given twice"),
])
def test_bad_cli_input_is_one_line(capsys, argv, message, tmp_path):
    assert main(["sweep", "--output-dir", str(tmp_path), *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3serve: error:") and message in err and "\n" not in err
    assert not (tmp_path / "points.jsonl").exists()


def test_dry_run_prints_every_point_and_its_command(capsys):
    assert main(["sweep", "--models", "k3-default", "--grid", "max_num_seqs=2,64", "--dry-run",
                 "--modelled", "GB300:8"]) == 0
    out = capsys.readouterr().out
    assert "k3serve serve k3-default --max-num-seqs 2\n" in out and "    k3serve serve k3-default\n" in out
    assert "[modelled] kimi-k3 GB300x8" in out
