"""In-engine: k3-default on the spec_decode.py workloads (tool, edit; seed 5, as the benchmark builds them),
batch 1, greedy, speculation off vs eagle3: equal outputs, mean acceptance length, decode wall time."""
import sys, time, json
sys.path.insert(0, ".")
from benchmarks.spec_decode import workloads
from k3serve.chat import K3, ChatOptions
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.models.loader import load_model
from training.tok import load_tokenizer

head, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tok = load_tokenizer()
loads = workloads(n, 5)
model, cfg = load_model("k3-default", progress=False)
params = SamplingParams(temperature=0, max_tokens=64)
for wl, bodies in [("tool", loads["tool"])]:
    prompts = [[int(i) for i in K3.render(b["messages"], b.get("tools"), ChatOptions(thinking=False, effort=None)).encode(tok.encode_segments)] for b in bodies]
    res = {}
    for name, spec in (("off", None), ("eagle3", SpeculativeConfig(method="eagle3", model=head, num_speculative_tokens=k))):
        eng = LLMEngine(model, model_config=cfg, config=EngineConfig(max_model_len=1024, speculative_config=spec))
        outs, secs, steps = [], 0.0, 0
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
            first = None
            while eng.has_unfinished_requests():
                o = eng.step()
                steps += 1
                if first is None:
                    first = time.perf_counter()
                for x in o:
                    if x.finished:
                        outs.append(x.token_ids)
            secs += time.perf_counter() - first
        s = eng.scheduler
        acc = 1 + s.num_accepted_tokens / s.num_spec_rows if s.num_spec_rows else None
        res[name] = (outs, secs, acc)
        toks = sum(len(o) - 1 for o in outs)
        print(f"{wl} {name}: tokens {sum(map(len, outs))}, decode tok/s {toks / secs:.1f}, "
              f"mean acceptance length {acc if acc is None else round(acc, 2)}", flush=True)
    print(f"{wl}: outputs equal: {res['off'][0] == res['eagle3'][0]}", flush=True)
