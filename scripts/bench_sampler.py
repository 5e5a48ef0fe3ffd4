import statistics, sys, time, torch
from minisgl.engine.batch import SampleInfo as I
from minisgl.engine.sampler import Sampler
from minisgl.sampling_params import SamplingParams as P
torch.set_num_threads(int(sys.argv[1]))
V, g = 49152, torch.Generator().manual_seed(0)
def logits(b):  # LLM-like: gaussian background + 20 strong tokens per row
    x = torch.randn(b, V, generator=g) * 2
    for r in range(b):
        x[r, torch.randint(0, V, (20,), generator=g)] += torch.rand(20, generator=g) * 4 + 8
    return x
def mixed(i):
    return [P(temperature=0), P(temperature=0.7, top_p=0.9), P(temperature=1.0, seed=i),
            P(temperature=0.8, top_k=50, top_p=0.95, presence_penalty=0.5,
              frequency_penalty=0.3, logprobs=5)][i % 4]
scen = {"greedy": lambda i: P(temperature=0), "T=0.7 top_p=0.9": lambda i: P(temperature=0.7, top_p=0.9),
        "mixed": mixed}
s = Sampler(V, torch.device("cpu"), seed=0)
for b in (1, 64):
    x = logits(b)
    for name, fn in scen.items():
        infos = [I(fn(i if b > 1 else 1), list(range(500)), list(range(1000, 1200))) for i in range(b)]
        for _ in range(3): s.sample(x, infos)
        w, c = [], []
        for _ in range(30 if b > 1 else 300):
            t0, c0 = time.perf_counter(), time.process_time(); s.sample(x, infos)
            w.append(time.perf_counter() - t0); c.append(time.process_time() - c0)
        print(f"B={b:2d} {name:16s} wall min {min(w)*1e3:6.3f} ms, median {statistics.median(w)*1e3:6.3f} ms; cpu median {statistics.median(c)*1e3:6.3f} ms")
