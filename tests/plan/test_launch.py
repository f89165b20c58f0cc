"""The plan's launch lines and figures as a newcomer reads them: a k3serve command that ``k3serve serve``
accepts, what it cannot do yet said apart, replica placement in words, units that fit the model's size."""

from __future__ import annotations

import json
import shlex

import pytest

from k3serve.cli import build_parser, main
from k3serve.entrypoints import serve_cli
from k3serve.plan.units import count, nbytes, nbytes_binary


def plan(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["plan"]
    assert main(["plan", *argv]) == 0
    return out, capsys.readouterr().out


def serve_args(command: str):
    """Parse a printed ``k3serve serve ...`` line with the real dispatcher and serve subparser."""
    tokens = shlex.split(command)
    assert tokens[:2] == ["k3serve", "serve"], command
    try:
        return build_parser(tokens[1:]).parse_args(tokens[1:])
    except SystemExit:
        pytest.fail(f"k3serve serve refuses the printed command: {command}")


@pytest.mark.parametrize("argv, needs", [
    (["--gpu", "H100"], ["--pipeline-parallel-size 4", "--nnodes 4"]),
    (["--gpu", "B300", "--context-length", "128k"], []),  # TP 4 x attention-DP 2, EP 8 on one node
    # TP 8 x attention-DP 2, EP 16: one dp group per 8-GPU host (engine/dp_hosts.py)
    (["--gpu", "H200", "--num-gpus", "16", "--tp", "8", "--pp", "1", "--attn-dp", "2", "--context-length", "128k"], []),
    # the planner's own pick there has pipeline stages, which k3serve lacks
    (["--gpu", "H200", "--num-gpus", "16", "--context-length", "128k"], ["--pipeline-parallel-size 2"]),
    (["--gpu", "H100", "--model", "k3-default"], []),
    (["--gpu", "H100", "--model", "k3-default", "--kv-cache-dtype", "fp8"], ["--kv-cache-dtype fp8"]),
])
def test_printed_k3serve_command_is_accepted_by_serve(capsys, monkeypatch, argv, needs):
    out, text = plan(capsys, *argv)
    args = serve_args(out["commands"]["k3serve"].replace("$NODE_RANK", "0").replace("$HEAD_ADDR", "10.0.0.1"))
    # serve's own flag checks, short of resolving the model (an HF id here) and starting anything
    # (the model's packaged config stands in for its download; the planned GPU for this machine's)
    from k3serve.models.registry import packaged_config

    config_of = {"moonshotai/Kimi-K3": "kimi-k3", "k3-default": "k3-default"}
    monkeypatch.setattr("k3serve.models.registry.resolve_model_path",
                        lambda name, **kw: packaged_config(config_of[name]))
    monkeypatch.setattr("k3serve.engine.config.check_device", lambda device: None)
    config = serve_cli.server_config(args)
    dp = out["layout"]["attn_dp"]  # --max-num-seqs is per engine core, one core per attention-DP group
    assert config.engine["device"] == "cuda" and config.engine["max_num_seqs"] == -(-out["concurrency"] // dp)
    if "--data-parallel-size" in out["commands"]["k3serve"]:  # experts over all tp x dp ranks: one world
        assert config.data_parallel_size == dp and config.engine["data_parallel_size"] == dp
    if "--nnodes" in out["commands"]["k3serve"] and dp > 1:  # one set of dp groups per host, tp inside a host
        assert config.engine["dp_nnodes"] == out["nodes_per_replica"] and config.engine["nnodes"] == 1
        assert config.engine["dp_address"] == "10.0.0.1"
    assert config.engine["max_model_len"] == out["context_length"]
    missing = out["k3serve_not_yet_supported"]
    assert all(n in missing for n in needs) and bool(missing) == bool(needs)
    # what k3serve cannot do yet is said in words next to its command, never left out silently
    assert ("not yet supported by k3serve" in text) == bool(needs)
    for flag in missing:
        assert flag not in out["commands"]["k3serve"]
        assert flag in text


def test_parallel_flags_stay_in_the_vllm_and_sglang_lines(capsys):
    out, _ = plan(capsys, "--gpu", "H100")
    assert "--tensor-parallel-size 8" in out["commands"]["vllm"] and "--tp 8" in out["commands"]["sglang"]
    assert "--nnodes 4" in out["commands"]["sglang"]
    # tensor parallelism is k3serve's own now; the pipeline stages are not
    assert "--tensor-parallel-size 8" in out["commands"]["k3serve"]
    assert "--pipeline-parallel-size" not in out["commands"]["k3serve"]


@pytest.mark.parametrize("argv, placement", [
    (["--gpu", "H100"], "32 GPUs (4 nodes of 8 GPUs per replica)"),
    (["--gpu", "B300"], "8 GPUs (one 8-GPU node)"),
    (["--gpu", "GB300"], "8 GPUs (2 nodes of 4 GPUs per replica, 9 replicas per NVL72 rack)"),
    (["--gpu", "H100", "--model", "k3-default"], "1 GPUs (8 replicas per 8-GPU node)"),
])
def test_plan_says_where_a_replica_sits(capsys, argv, placement):
    out, text = plan(capsys, *argv)
    assert f"planned replica {placement}" in text
    assert "0 per node" not in text and "node(s)" not in text
    assert out["gpus_per_node"] * out["nodes_per_replica"] >= out["replica_gpus"]


def test_units_fit_the_number():
    assert [count(n) for n in (2_779_931_834_976, 104.2e9, 11_708_216, 786_432, 192)] == [
        "2,779.9B", "104.2B", "11.7M", "786.4K", "192"]
    assert count(12.3e12) == "12.3T"
    assert [nbytes(b) for b in (1560.9e9, 22.3e6, 4200, 512)] == ["1,560.9 GB", "22.3 MB", "4.2 KB", "512 B"]
    assert [nbytes_binary(b) for b in (1560.9e9, 27 * 2**30, 13.5 * 2**10, 480)] == [
        "1.42 TiB", "27.0 GiB", "13.5 KiB", "480 B"]


def test_small_model_figures_are_not_zero(capsys):
    assert main(["params", "--model", "k3-default"]) == 0
    text = capsys.readouterr().out
    assert "(11.7M)" in text and "22.3 MB (21.2 MiB)" in text
    assert "0.0 GB" not in text and "0.01B" not in text and "0.000 TiB" not in text
    assert main(["plan", "--model", "k3-default"]) == 0
    text = capsys.readouterr().out
    assert "model k3-default: 11.7M params" in text and "22.3 MB MXFP4" in text
    assert "0.0B" not in text and "0.0 GB" not in text and "0.00 GiB" not in text


def test_large_model_figures_keep_their_units(capsys):
    assert main(["params", "--model", "kimi-k3"]) == 0
    text = capsys.readouterr().out
    assert "(2,779.9B)" in text and "1,560.9 GB (1.42 TiB)" in text


def test_multi_node_tp_ep_command_parses_on_every_node(capsys, monkeypatch):
    """A flat TP+EP replica over two H200 nodes: the printed k3serve line carries the tp, expert and node flags
    itself, and with the placeholders filled in (as each node's shell does) serve accepts it on both nodes."""
    out, text = plan(capsys, "--gpu", "H200", "--tp", "16", "--context-length", "128k")
    line = out["commands"]["k3serve"]
    for flag in ("--tensor-parallel-size 16", "--enable-expert-parallel", "--nnodes 2", "--node-rank $NODE_RANK",
                 "--master-addr $HEAD_ADDR"):
        assert flag in line, line
    assert out["k3serve_not_yet_supported"] == [] and "not yet supported by k3serve" not in text
    from k3serve.models.registry import packaged_config

    monkeypatch.setattr("k3serve.models.registry.resolve_model_path",
                        lambda name, **kw: packaged_config("kimi-k3"))
    monkeypatch.setattr("k3serve.engine.config.check_device", lambda device: None)
    for node in (0, 1):
        args = serve_args(line.replace("$NODE_RANK", str(node)).replace("$HEAD_ADDR", "10.0.0.1"))
        assert (args.node_rank, args.nnodes, args.master_addr) == (node, 2, "10.0.0.1")
        engine = serve_cli.server_config(args).engine
        assert engine["tensor_parallel_size"] == 16 and engine["expert_parallel"] and engine["nnodes"] == 2


@pytest.mark.parametrize("argv, says", [
    # the reported case: tp16 fits its weights but not one 1M-token sequence of MLA KV, which every TP rank holds
    (["--gpu", "H200", "--tp", "16"], ["leave 20.9 GB", "up to 754,044 tokens", "16 GPUs fit with another layout",
                                       "needs 29.0 GB (MLA latent KV 29.0 GB, whole on every TP rank",
                                       "pipeline parallelism: 2 stages (tp16pp2dp1ep16, 32 GPUs)"]),
    # too few GPUs: the weights alone exceed the budget
    (["--gpu", "H200", "--num-gpus", "8"], ["weights 205.2 GB", "by 76.2 GB before any KV cache",
                                            "smallest replica that fits is 16 GPUs"]),
])
def test_no_fit_says_which_memory_term_fails(capsys, argv, says):
    assert main(["plan", *argv]) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "minimum is" not in err, err
    for s in says:
        assert s in err, (s, err)


def test_k3serve_today_on_16_h200_is_the_longest_context_tp8_dp2_holds(capsys, monkeypatch):
    """At 1M tokens the plan's 16-H200 layout needs pipeline stages; the planner then prints the best layout
    k3serve runs (TP 8 x attention-DP 2, one dp group per host) at the longest context it holds: that context
    fits and 1,024 more tokens do not, and serve accepts the printed line on both hosts."""
    out, text = plan(capsys, "--gpu", "H200", "--num-gpus", "16")
    assert out["k3serve_not_yet_supported"] and out["layout"]["pp"] > 1
    today = out["k3serve_today"]
    assert today["layout"] == "tp8pp1dp2ep16" and today["reason"] == "longest" and today["max_concurrency"] >= 1
    ctx = today["context_length"]
    assert ctx % 1024 == 0 and f"the longest context one holds is {ctx:,} tokens" in text
    forced = ("--gpu", "H200", "--num-gpus", "16", "--tp", "8", "--pp", "1", "--attn-dp", "2")
    assert plan(capsys, *forced, "--context-length", str(ctx))[0]["max_concurrency"] >= 1
    from k3serve.cli import main

    assert main(["plan", *forced, "--context-length", str(ctx + 1024)]) != 0
    assert "does not fit" in capsys.readouterr().err
    from k3serve.models.registry import packaged_config

    monkeypatch.setattr("k3serve.models.registry.resolve_model_path", lambda name, **kw: packaged_config("kimi-k3"))
    monkeypatch.setattr("k3serve.engine.config.check_device", lambda device: None)
    for node in (0, 1):
        args = serve_args(today["command"].replace("$NODE_RANK", str(node)).replace("$HEAD_ADDR", "10.0.0.1"))
        engine = serve_cli.server_config(args).engine
        assert (engine["tensor_parallel_size"], engine["data_parallel_size"], engine["dp_nnodes"]) == (8, 2, 2)
        assert engine["max_model_len"] == ctx and engine["dp_address"] == "10.0.0.1" and args.node_rank == node


def test_readme_16_h200_line_is_the_planners(capsys):
    """The README's two-host H200 command is what `k3serve plan --gpu H200 --num-gpus 16` prints today."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    out, _ = plan(capsys, "--gpu", "H200", "--num-gpus", "16")
    assert out["k3serve_today"]["command"] in readme
    assert f"up to\n{out['k3serve_today']['context_length']:,} tokens" in readme
