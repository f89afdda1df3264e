"""First-step compile time against depth (bench section `compile`): an SDPA GPT (d=64, batch 8 x 32) of DEPTH blocks,
2 AdamW steps (2 graphs: the step, then the step with optimizer state), then timed steps, on 4 XLA devices.

    python bench/compile_depth.py MODE DEPTH [STEPS]

MODE: hand       the hand-written torch_xla SPMD loop: the model moved, its batch marked, torch_xla.sync() a step
      shim       the same loop through SeamlessTPUTrainer
      hand_scan  hand, with the blocks run by torch_xla's scan_layers (one block traced, looped): torch_xla 2.9
                 raises ModuleNotFoundError (jax) in its SPMD backward unless torch_xla[pallas] is installed
      shim_scan  shim, the same (the trainer runs it without jax)
Prints one line RESULT {"compile_s": XLA's CompileTime over the 2 warm-up steps, "graphs", "step_s": median
seconds of a steady step, "loss"}. A process per run: SPMD is one-way, and XLA's in-memory cache would hit.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from work_split import GPT  # noqa: E402  (the tests' nanoGPT, d=64)

B, T, V = 8, 32, 256


def main(mode, depth, steps=10):
    import numpy as np

    torch.manual_seed(0)
    model = GPT(int(depth), scan=mode.endswith("scan"), seq=T, vocab=V)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(V, (B, T + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()
    if mode.startswith("shim"):
        import seamless_tpu as st

        trainer = st.SeamlessTPUTrainer(model)
        x, y = trainer.to_device(x, y)

        def step():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            return loss
    else:
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        device = torch_xla.device()
        mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (xr.global_runtime_device_count(),), ("data",))
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after the move: the new parameters
        x, y = x.to(device), y.to(device)
        xs.mark_sharding(x, mesh, ("data", None))
        xs.mark_sharding(y, mesh, ("data",))

        def step():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            torch_xla.sync()
            return loss
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    for _ in range(2):
        loss = step()
    xm.wait_device_ops()
    compile_ns = (met.metric_data("CompileTime") or (0, 0))[1]
    graphs = met.counter_value("UncachedCompile") or 0
    times = []
    for _ in range(int(steps)):
        start = time.perf_counter()
        loss = step()
        xm.wait_device_ops()
        times.append(time.perf_counter() - start)
    print("RESULT " + json.dumps({"compile_s": compile_ns / 1e9, "graphs": graphs, "step_s": statistics.median(times),
                                  "loss": float(loss.detach().cpu())}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
