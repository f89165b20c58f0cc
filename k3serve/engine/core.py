"""The engine-core process: `LLMEngine` behind two ZMQ sockets, typed messages only.

    python -m k3serve.engine.core '<CoreSpec as JSON>'

It PULLs `AddRequest` / `AbortRequest` / `Shutdown` from its client (`engine/client.py`: the HTTP server,
or a test) and PUSHes `Ready` once, then `Outputs` after every step (and a heartbeat `Outputs` with stats
each second when idle). It exits when told to, and by itself when its parent is gone (or, a replica on another
host, when its client has been silent for ``client_timeout_s``: ``engine/dp_hosts.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import Future

import msgspec
import zmq

from k3serve.core.process import die_with_parent
from k3serve.engine.core_spec import CoreSpec, build_engine
from k3serve.engine.messages import (
    AbortRequest,
    AddRequest,
    Fatal,
    ImageData,
    Output,
    Outputs,
    Ready,
    Shutdown,
    Stats,
    Wake,
    encode,
    to_engine_decoder,
    to_output,
)
from k3serve.engine.stats_log import StatsLogger

log = logging.getLogger("k3serve.engine")
stats_log = logging.getLogger("k3serve.stats")
HEARTBEAT_S = 1.0
COMPILE_POLL_MS = 5  # how often an idle loop looks for grammars compiled aside


_PIXEL_DTYPES = ("float32", "float16", "bfloat16")


def image_input(d: ImageData):
    """An engine ``ImageInput`` from the wire form (the pixel bytes are copied once into a tensor)."""
    import torch

    from k3serve.engine.multimodal import ImageInput

    if d.dtype not in _PIXEL_DTYPES:
        raise ValueError(f"images: pixel dtype must be one of {', '.join(_PIXEL_DTYPES)}, got {d.dtype!r}")
    dtype = getattr(torch, d.dtype)
    count = 1
    for x in d.shape:
        count *= x
    if min(d.shape, default=0) < 1 or count * dtype.itemsize != len(d.pixels):
        raise ValueError(f"images: {len(d.pixels)} pixel bytes do not fill shape {d.shape} of {d.dtype}")
    if len(d.grid_thw) != 3:
        raise ValueError(f"images: grid_thw must be [t, h, w], got {d.grid_thw}")
    pixels = torch.frombuffer(bytearray(d.pixels), dtype=dtype).reshape(d.shape)
    return ImageInput(d.offset, d.length, pixel_patches=pixels, grid_thw=tuple(d.grid_thw))


def _stats(engine, pd=None) -> Stats:
    s = engine.stats()
    extra = pd.stats() if pd is not None else {}
    return Stats(num_running=s.num_running, num_waiting=s.num_waiting, num_blocks=s.num_blocks,
                 num_blocks_used=s.num_blocks_used, num_blocks_cached=s.num_blocks_cached,
                 num_snapshot_slots=s.num_snapshot_slots, num_snapshots=s.num_snapshots,
                 num_admitted_tokens=s.num_admitted_tokens, num_prefix_hit_tokens=s.num_prefix_hit_tokens,
                 num_computed_tokens=s.num_computed_tokens, num_generated_tokens=s.num_generated_tokens,
                 num_preemptions=s.num_preemptions, num_steps=s.num_steps,
                 num_free_slots=engine.states.num_running_free, num_slots=engine.states.max_running,
                 num_spec_rows=s.num_spec_rows, num_draft_tokens=s.num_draft_tokens,
                 num_accepted_tokens=s.num_accepted_tokens, num_expert_replicas=s.num_expert_replicas,
                 num_dummy_steps=s.num_dummy_steps, **extra)


def _kv_events_key(spec: CoreSpec):
    """The KV events key from the secret in the environment (taken out of it: nothing else here needs it)."""
    from k3serve.core import kv_auth

    if spec.kv_events_host is None:
        return None
    secret = os.environ.pop(kv_auth.KEY_ENV, None) if spec.kv_events_keyed else None
    if spec.kv_events_keyed and not secret:
        raise ValueError(f"kv_events_keyed: the secret must come in {kv_auth.KEY_ENV}")
    kv_auth.check_exposure(spec.kv_events_host, secret)
    return kv_auth.KVEventsKey.from_secret(secret) if secret else None


class EngineCore:
    def __init__(self, spec: CoreSpec, par=None, group=None):
        from k3serve.engine.guided import MIN_VOCAB, GuidedDecoding
        key = _kv_events_key(spec)
        self.group = group  # the tp step channel when this core is rank 0 of several
        # data-parallel cores sharing the experts: one forward per iteration on every core (engine/dp_sync.py)
        self.dp_sync = group.dp_sync if group is not None else None
        self.anyone_busy = False  # lockstep: whether the last reduction found work on any core (engine/dp_sync.py)
        self.engine = build_engine(spec, par, group, hash_key=key.hash_key if key else b"")
        eos = self.engine.eos_token_ids
        self.guide = GuidedDecoding(self.engine.vocab_size, eos[0] if eos else 0,
                                    enabled=self.engine.vocab_size >= MIN_VOCAB)
        self.compiling: dict[str, tuple[AddRequest, Future]] = {}  # requests waiting for their grammar
        self.kv_events = None
        if spec.kv_events_host is not None:
            from k3serve.engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(self.engine, spec.kv_events_host, key)
        from k3serve.engine.pd.role import PDRole

        self.pd = PDRole(self.engine, spec.role, host=spec.handoff_host, timeout_s=spec.handoff_timeout_s)

    def ready(self) -> Ready:
        mc = self.engine.model_config
        return Ready(model_type=mc.model_type, vocab_size=self.engine.vocab_size,
                     max_model_len=self.engine.max_model_len, eos_token_ids=list(self.engine.eos_token_ids),
                     media_placeholder_token_id=mc.media_placeholder_token_id, stats=_stats(self.engine, self.pd),
                     kv_events=self.kv_events.info if self.kv_events is not None else None,
                     supports_images=self.engine.supports_images)

    def handle(self, msg) -> list[Output]:
        if isinstance(msg, Wake):  # it only ended the wait for messages
            return []
        if isinstance(msg, AddRequest):
            if not self.guide.compiled(msg.grammar):  # a fresh grammar compiles aside; the batch keeps stepping
                self.compiling[msg.request_id] = (msg, self.guide.compile_later(msg.grammar))
                return []
            return self._add(msg)
        if isinstance(msg, AbortRequest):
            for rid in msg.request_ids:
                compiling = self.compiling.pop(rid, None)
                if compiling is None:
                    self.pd.abort(rid)
                    self.engine.abort_request(rid)
                elif compiling[0].handoff is not None:
                    self.pd.nack(compiling[0].handoff, "aborted before it was added")
        return []

    def _add(self, msg: AddRequest, template=None) -> list[Output]:
        try:
            proc = self.guide.processor(msg.grammar, dict(msg.logit_bias), msg.request_id, template)
            images = [image_input(d) for d in msg.images]
            if msg.handoff is not None:  # decode side: the caches (and the first token) come from a prefill worker
                self.pd.add(msg, images, proc)
            else:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, images=images,
                                        logits_processor=proc, prefill_only=self.pd.prefill_only)
        except (ValueError, TypeError) as e:  # refused: the client raises it for this request
            if msg.handoff is not None:  # and the prefill worker frees its copy now, not at its timeout
                self.pd.nack(msg.handoff, str(e))
            return [Output(msg.request_id, [], finished=True, error=str(e))]
        return []

    def admit_compiled(self) -> list[Output]:
        """Add the requests whose grammar finished compiling (or fail those whose grammar could not)."""
        out: list[Output] = []
        for rid, (msg, fut) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            try:
                template = fut.result()
            except Exception as e:  # noqa: BLE001 - a grammar llguidance rejects fails its request only
                error = str(e) if isinstance(e, ValueError) else f"grammar: {type(e).__name__}: {e}"
                if msg.handoff is not None:
                    self.pd.nack(msg.handoff, error)
                out.append(Output(rid, [], finished=True, error=error))
                continue
            out += self._add(msg, template)
        return out

    def turn(self) -> list[Output]:
        """One pass of the loop after the client's messages: admit compiled grammars, move hand-offs, step."""
        outputs = self.admit_compiled() if self.compiling else []
        outputs += self.pd.pump()
        if self.dp_sync is not None:  # every core reduces once per iteration, and steps iff anyone has work
            self.anyone_busy = self.dp_sync.any_work(self.engine.has_unfinished_requests())
            if self.anyone_busy:
                outputs += self.step()
        elif self.engine.has_unfinished_requests():
            outputs += self.step()
        # after the step too: a prefill hand-off is fetchable from the step that sampled its token, and on the
        # decode side a manifest that arrived during the step is imported here; its first token (for
        # max_tokens=1 its only, finished, output) must reach the client, or that stream never ends
        outputs += self.pd.pump()
        return outputs

    def step(self) -> list[Output]:
        try:
            outs = self.engine.step() if self.dp_sync is None else self.engine.step_or_dummy()
        except Exception as e:  # a failed step fails its requests, not the process
            if self.group is not None:  # other ranks may be mid-collective: this rank set cannot go on
                raise
            log.exception("engine step failed; aborting all requests")
            ids = list(self.engine.scheduler.requests)
            self.guide.take_failures()  # those requests end here anyway
            for rid in ids:
                self.engine.abort_request(rid)
            return [Output(rid, [], finished=True, error=f"engine step failed: {e}") for rid in ids]
        # a request whose grammar gave up this step: its token was sampled unconstrained, so it is dropped and
        # the request ends with an error (never a silent, schema-violating success)
        failed = dict(self.guide.take_failures())
        for rid in failed:
            self.engine.abort_request(rid)
        items = [Output(rid, [], finished=True, error=f"grammar: the structured-output engine gave up on this "
                                                         f"schema, so the output cannot follow it ({why})")
                 for rid, why in failed.items()]
        items += [to_output(o, self.pd.ticket(o.request_id)) for o in outs if o.request_id not in failed]
        return items


def serve(spec: CoreSpec) -> int:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(spec.input_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(spec.output_addr)
    push.setsockopt(zmq.LINGER, 1000)
    parent = os.getppid()
    watchdog = None
    try:
        from k3serve.engine.ranks import start_ranks

        par, group, watchdog = start_ranks(spec)
        core = EngineCore(spec, par, group)
    except Exception as e:  # noqa: BLE001 - reported to the client as one line
        push.send(encode(Fatal(f"{type(e).__name__}: {e}")))
        push.close()
        ctx.term()
        if watchdog is not None:
            watchdog.stopping.set()  # its workers die with this process
        return 1
    push.send(encode(core.ready()))
    try:
        code = _loop(spec, core, pull, push, parent)
        if core.group is not None:  # asked to stop: the workers leave through the same broadcast
            watchdog.stopping.set()
            core.group.send_shutdown()
            watchdog.stop()
        return code
    except Exception as e:  # noqa: BLE001 - a lost rank (or a failed tp step) ends the rank set, in one line
        if watchdog is not None:
            watchdog.stopping.set()  # no broadcast to a broken group: the workers die with this process
        log.exception("engine core stopping")
        push.send(encode(Fatal(f"{type(e).__name__}: {e}")))
        return 1
    finally:
        if core.kv_events is not None:
            core.kv_events.close()
        core.pd.close()
        pull.close(0)
        push.close(0)
        ctx.term()


def _loop(spec: CoreSpec, core: EngineCore, pull, push, parent: int) -> int:
    engine = core.engine
    last_beat = 0.0
    last_heard = time.monotonic()  # from the client: a remote one (engine/dp_hosts.py) beats every second
    stats_logger = StatsLogger(spec.log_stats_interval, _stats(engine, core.pd), time.monotonic())
    while True:
        busy = engine.has_unfinished_requests() or core.anyone_busy
        outputs: list[Output] = []
        # while only grammars compile, wake often to admit them; never spin
        wait = 0 if busy else COMPILE_POLL_MS if core.compiling else int(HEARTBEAT_S * 1000)
        if _poll(pull, core.kv_events, core.pd.sockets(), wait):
            while True:
                try:
                    raw = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                last_heard = time.monotonic()
                msg = to_engine_decoder.decode(raw)
                if isinstance(msg, Shutdown):
                    return 0
                outputs += core.handle(msg)
        if spec.client_timeout_s and time.monotonic() - last_heard > spec.client_timeout_s:
            log.error("nothing from the client for %.0fs (its host is gone?): stopping", spec.client_timeout_s)
            return 1
        outputs += core.turn()
        if core.kv_events is not None:
            core.kv_events.pump()
        now = time.monotonic()
        if core.group is not None and not busy and now - last_beat >= HEARTBEAT_S:
            core.group.send_noop()  # idle workers wait in a broadcast: keep it short of its timeout
        if outputs or now - last_beat >= HEARTBEAT_S:
            stats = _stats(engine, core.pd)
            push.send(encode(Outputs(outputs, stats)))
            if (line := stats_logger.update(stats, now)) is not None:
                stats_log.info(line)
            last_beat = now
            if os.getppid() != parent:  # the client is gone: do not linger as an orphan
                return 0


def _poll(pull, kv_events, handoff_sockets: list, timeout_ms: int) -> bool:
    """Wait for client messages (True when some are there); a KV state request or a hand-off message also
    ends the wait."""
    if kv_events is None and not handoff_sockets:
        return bool(pull.poll(timeout_ms))
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    extra = handoff_sockets if kv_events is None else [kv_events.requests, *handoff_sockets]
    for s in extra:
        poller.register(s, zmq.POLLIN)
    return pull in dict(poller.poll(timeout_ms))


def main(argv: list[str]) -> int:
    die_with_parent()  # first: a client killed while we load must not leave us behind
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    stats_log.setLevel(logging.INFO)
    if len(argv) != 1:
        print("usage: python -m k3serve.engine.core '<CoreSpec JSON>'", file=sys.stderr)
        return 2
    try:
        return serve(msgspec.json.decode(argv[0], type=CoreSpec))
    except KeyboardInterrupt:  # Ctrl-C in a terminal reaches the whole process group; the client stops us
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
