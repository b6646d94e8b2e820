import sys, time, threading
import numpy as np, torch
from concurrent.futures import ThreadPoolExecutor
from bench.models import random_pipeline
from auk_worker.types import RenderRequest
INSTRUCT = 'Generate speech based on the following description: "A calm voice." The content to speak is: "Hello."'
t=time.time(); pipe = random_pipeline("base", "cuda", "fast"); print("load", time.time()-t, flush=True)
req = RenderRequest(INSTRUCT, gen_seconds=3.0, seed=21)
for _ in range(2): here = pipe.render(req).waveform
torch.cuda.synchronize(); t=time.perf_counter(); here = pipe.render(req).waveform; main_s=time.perf_counter()-t
steps=[]
def job():
    torch.cuda.set_device(pipe.device)
    out=[]
    for _ in range(3):
        t=time.perf_counter(); w=pipe.render(req, on_step=lambda s, n: steps.append(s)).waveform; out.append((w, time.perf_counter()-t))
    return out
with ThreadPoolExecutor(max_workers=1) as pool:
    res = pool.submit(job).result()
print("main thread render s", round(main_s,4), "render thread s", [round(s,4) for _, s in res], flush=True)
print("bit-identical", all(np.array_equal(here, w) for w, _ in res), "last step", steps[-1], flush=True)
