"""Serve flags reach the engine a core builds: ``server_config`` -> ``CoreSpec`` -> ``build_engine``."""

from __future__ import annotations

import argparse

from k3serve.engine.core_spec import CoreSpec, build_engine


def test_state_cache_interval_reaches_the_scheduler():
    from k3serve.entrypoints.serve_cli import add_arguments, server_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    engine = server_config(p.parse_args(["k3-tiny-random", "--state-cache-interval", "32"])).engine
    assert engine["state_cache_interval"] == 32
    spec = CoreSpec(model="k3-tiny-random", input_addr="", output_addr="",
                    **{k: v for k, v in engine.items() if k in ("state_cache_interval", "max_num_seqs")},
                    kv_cache_memory=16 * 2**20, max_model_len=256)
    assert build_engine(spec).scheduler.interval == 32
    assert build_engine(CoreSpec(model="k3-tiny-random", input_addr="", output_addr="", kv_cache_memory=16 * 2**20,
                                 max_model_len=256)).scheduler.interval == 0
