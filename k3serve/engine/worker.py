"""A tensor-parallel worker rank: loads its part of the model, then runs every step rank 0 broadcasts.

    python -m k3serve.engine.worker '<CoreSpec as JSON>'     (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

It builds the same ``LLMEngine`` as rank 0 (same cache plan, agreed over the group, so the same block and
slot numbering), then loops: receive ``StepInputs`` -> ``ModelRunner.execute`` (prefix-hit and snapshot slot
copies included; the logits are dropped, rank 0 samples) until ``SHUTDOWN``. It never schedules. Between steps, a
prefill/decode hand-off on rank 0 asks for this rank's KDA rows of a request, or sends it imported rows and
latents (``ROWS_OUT`` / ``ROWS_IN``, ``engine/pd/rank_rows.py``). Exit codes:
0 when told to stop, 1 when the group broke or a step failed (rank 0's watchdog then stops the others).
"""

from __future__ import annotations

import logging
import sys

import msgspec

from k3serve.core.process import die_with_parent

log = logging.getLogger("k3serve.engine")


def follow(engine, group) -> None:
    """Run every step rank 0 broadcasts on this rank's ``engine`` until it says SHUTDOWN."""
    from k3serve.engine.pd.rank_rows import follow_rows
    from k3serve.engine.step_inputs import ROWS_IN, ROWS_OUT, SHUTDOWN, STEP

    while True:
        kind, inputs = group.recv()
        if kind == SHUTDOWN:
            return
        if kind == STEP:
            engine.runner.execute(inputs)
        elif kind in (ROWS_OUT, ROWS_IN):  # a hand-off on rank 0: its KDA rows out, or imported rows in
            follow_rows(engine, group, kind, inputs)


def run_worker(spec) -> int:
    from k3serve.engine.core_spec import build_engine
    from k3serve.engine.tp_group import RankLost, join

    par, group = join(spec.layout(), spec.device)
    try:
        follow(build_engine(spec, par, group), group)
        return 0
    except RankLost as e:
        log.error("rank %d: %s", par.rank, e)
        return 1
    except Exception:  # noqa: BLE001 - this rank cannot follow the group any more
        log.exception("rank %d: step failed", par.rank)
        return 1


def main(argv: list[str]) -> int:
    die_with_parent()  # first: rank 0 killed while we load must not leave us behind
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s tp-worker: %(message)s")
    if len(argv) != 1:
        print("usage: python -m k3serve.engine.worker '<CoreSpec JSON>'", file=sys.stderr)
        return 2
    from k3serve.engine.core_spec import CoreSpec

    try:
        return run_worker(msgspec.json.decode(argv[0], type=CoreSpec))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
