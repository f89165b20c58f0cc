import json

import pytest

from k3serve.cli import main


@pytest.fixture
def tiny_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1500, "output_length": 3, "hash_ids": [1, 2, 3 + i]}
            for i in range(6)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_has_the_promised_fields(capsys, tiny_trace):
    rc, out, err = run(capsys, "route", "simulate", "--trace", tiny_trace, "--replicas", "2",
                       "--cache-blocks", "50%", "--json")
    assert rc == 0 and err == ""
    d = json.loads(out)
    for key in ("hit_rate", "ideal_hit_rate", "load_max_over_mean", "ttft_p50_s", "ttft_p99_s"):
        assert isinstance(d[key], float)
    assert d["policy"] == "kv" and d["cache_blocks"] == 4  # 50% of 8 distinct blocks


def test_compare_table_lists_every_policy(capsys, tiny_trace):
    rc, out, _ = run(capsys, "route", "simulate", "--trace", tiny_trace, "--replicas", "3",
                     "--cache-blocks", "20", "--compare")
    assert rc == 0
    header = out.splitlines()[1].split()
    assert header == ["kv", "round_robin", "least_load", "session"]
    assert "TTFT p99 (s)" in out


@pytest.mark.parametrize("argv, needle", [
    (["--trace", "/nonexistent/trace.jsonl", "--replicas", "2", "--cache-blocks", "10"], "not found"),
    (["--replicas", "2", "--cache-blocks", "10", "--policy", "random"], "unknown routing policy"),
    (["--replicas", "0", "--cache-blocks", "10"], "--replicas"),
    (["--replicas", "2", "--cache-blocks", "ten"], "--cache-blocks"),
    (["--replicas", "2", "--cache-blocks", "0"], "--cache-blocks"),
    (["--replicas", "2", "--cache-blocks", "10", "--repeat", "0"], "repeat"),
    (["--replicas", "2", "--cache-blocks", "10", "--prefill-tokens-per-s", "-5"], "prefill_tokens_per_s"),
])
def test_bad_input_is_one_line_and_nonzero(capsys, tiny_trace, argv, needle):
    if "--trace" not in argv:
        argv = ["--trace", tiny_trace, *argv]
    rc, out, err = run(capsys, "route", "simulate", *argv)
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err
    assert "Traceback" not in err


def test_live_router_needs_replicas(capsys):
    rc, out, err = run(capsys, "route")
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and "--replica" in err


@pytest.mark.parametrize("argv, needle", [
    (["--replica", "127.0.0.1:8001"], "http(s) URL"),
    (["--replica", "http://a:1", "--replica", "http://a:1"], "twice"),
    (["--replica", "http://a:1", "--policy", "fastest"], "--policy"),
    (["--replica", "http://a:1", "--port", "0"], "--port"),
])
def test_live_router_bad_flags_are_one_line(capsys, argv, needle):
    rc, out, err = run(capsys, "route", *argv)
    assert rc != 0 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_readme_command_works_without_cache_blocks(capsys, tiny_trace):
    """README: `k3serve route simulate --trace trace.jsonl --replicas 8 --policy kv`; the cache defaults to 10%."""
    rc, out, err = run(capsys, "route", "simulate", "--trace", tiny_trace, "--replicas", "8", "--policy", "kv",
                       "--json")
    assert rc == 0 and err == ""
    assert json.loads(out)["cache_blocks"] == 1  # 10% of 8 distinct blocks, rounded


def test_acceptance_kv_on_the_mooncake_trace(capsys, mooncake_trace):
    """Issue 7 acceptance 1 on the in-repo slice of the synthetic trace: 8 replicas, each cache ~10% of the
    trace's distinct blocks (the default); the full trace's run is in benchmarks/RESULTS.md."""
    rc, out, _ = run(capsys, "route", "simulate", "--trace", str(mooncake_trace), "--replicas", "8",
                     "--policy", "kv", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["cache_blocks"] == 318  # 10% of the slice's 3,179 distinct blocks
    assert d["ideal_hit_rate"] > 0.5  # the slice has real prefix reuse to route for
    assert d["hit_rate"] >= 0.95 * d["ideal_hit_rate"]
    assert d["load_max_over_mean"] <= 1.2
    rc, out, _ = run(capsys, "route", "simulate", "--trace", str(mooncake_trace), "--replicas", "8",
                     "--json", "--policy", "round_robin")
    assert json.loads(out)["hit_rate"] < 0.5 * d["hit_rate"]
