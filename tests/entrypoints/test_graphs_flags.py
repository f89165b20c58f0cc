"""``k3serve serve`` CUDA-graph flags (``entrypoints/graphs_cli.py``): defaults (off until checked on a GPU), the
engine fields they give, one-line refusals, the --help text, and a replica's argv carrying them."""

from __future__ import annotations

import argparse

import pytest

from k3serve.cli import build_parser, main
from k3serve.entrypoints.graphs_cli import check_graphs
from k3serve.entrypoints.replicas_cli import replica_argv
from k3serve.entrypoints.serve_cli import server_config


def _args(*flags: str) -> argparse.Namespace:
    return build_parser(["serve"]).parse_args(["serve", "kimi-linear-tiny-random", *flags])


def test_defaults_off_and_asked_for_on_cuda():
    assert check_graphs(_args()) == {"cuda_graphs": "off", "cuda_graph_max_batch": 32, "cuda_graph_max_context": 8192}
    # off by default on cuda too until the GPU check has passed (the graph runner is proven on CPU only)
    assert check_graphs(_args("--device", "cuda"))["cuda_graphs"] == "off"
    assert check_graphs(_args("--device", "cuda:1", "--cuda-graphs"))["cuda_graphs"] == "on"
    assert check_graphs(_args("--device", "cuda", "--enforce-eager"))["cuda_graphs"] == "off"
    got = check_graphs(_args("--device", "cuda", "--cuda-graphs", "--cuda-graph-max-batch", "8",
                             "--cuda-graph-max-context", "1024"))
    assert got == {"cuda_graphs": "on", "cuda_graph_max_batch": 8, "cuda_graph_max_context": 1024}
    assert check_graphs(_args("--device", "cuda", "-tp", "2"))["cuda_graphs"] == "off"


def test_server_config_carries_the_fields():
    engine = server_config(_args("--cuda-graph-max-batch", "4")).engine
    assert engine["cuda_graphs"] == "off" and engine["cuda_graph_max_batch"] == 4


@pytest.mark.parametrize("flags,needle", [
    (["--cuda-graphs"], "--cuda-graphs: needs --device cuda, got 'cpu'"),
    (["--device", "cuda", "--cuda-graphs", "-tp", "2"], "not supported with tensor parallelism"),
    (["--device", "cuda", "--cuda-graphs", "--tp-pieces", "2"], "not supported with tensor parallelism"),
    (["--device", "cuda", "--cuda-graphs", "-dp", "2"], "not supported with data or expert parallelism"),
    (["--device", "cuda", "--cuda-graphs", "--enable-expert-parallel"], "data or expert parallelism"),
    (["--device", "cuda", "--cuda-graphs", "--speculative-config", '{"method": "ngram"}'], "speculative decoding"),
    (["--device", "cuda", "--cuda-graphs", "--role", "decode"], "--role decode"),
    (["--cuda-graph-max-batch", "0"], "--cuda-graph-max-batch must be >= 1, got 0"),
    (["--cuda-graph-max-context", "1"], "--cuda-graph-max-context must be >= 2, got 1"),
])
def test_refusals(flags, needle):
    with pytest.raises(ValueError, match=r"^--cuda-graph") as e:
        check_graphs(_args(*flags))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_in_one_line(capsys):
    assert main(["serve", "kimi-linear-tiny-random", "--cuda-graphs"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cuda-graphs: needs --device cuda" in err[0]


def test_eager_and_graphs_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        _args("--cuda-graphs", "--enforce-eager")
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_explains():
    parser = build_parser(["serve"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    text = " ".join(sub.format_help().split())
    for needle in ("--cuda-graphs", "--enforce-eager", "--cuda-graph-max-batch ROWS",
                   "--cuda-graph-max-context TOKENS", "run eager"):
        assert needle in text


def test_replica_argv_keeps_the_flags():
    argv = replica_argv(_args("--enforce-eager", "--cuda-graph-max-batch", "8"))
    assert "--enforce-eager" in argv and argv[argv.index("--cuda-graph-max-batch") + 1] == "8"
    assert "--cuda-graphs" not in argv
