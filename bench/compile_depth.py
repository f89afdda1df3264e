"""First-run compile time against depth (bench section `compile`), on 4 XLA devices, for two workloads:

    python bench/compile_depth.py MODE DEPTH [STEPS] [WORKLOAD]

WORKLOAD: gpt  an SDPA GPT (d=64, batch 8 x 32) of DEPTH blocks, AdamW (the default)
          kd   the seeds' workload: a Qwen3 student of DEPTH layers with LoRA (r=8) on q/k/v/o, a frozen Qwen3
               teacher of the same shape, F.kl_div on log targets at T=2 (8 x 64 tokens), AdamW on the adapters;
               both built from configs with random weights (transformers, peft), no downloads
MODE: hand       the hand-written torch_xla SPMD loop: the model moved, its batch marked, torch_xla.sync() a step
      shim       the same loop through SeamlessTPUTrainer (repeated blocks as one loop; kd: as the seeds' user
                 writes it, transformers' defaults (its cache in training), the teacher moved by .to: its layers
                 loop too)
      shim_unrolled  shim with scan=False: every block traced and compiled
      shim_no_cache  kd only: shim with use_cache=False and the teacher by a trainer of its own (the bench before
                 issue 61, kept as a comparison)
      seed       kd only: the seeds' own loop, hand-written with a sync after the teacher's forward, the backward and
                 the optimizer's step (their xla_mark_step(), torch_xla.sync() today)
      hand_cut   hand, with a sync between the backward and the optimizer's step (the seed's second cut alone)
      hand_scan  gpt only: hand, with the blocks run by torch_xla's scan_layers (one block traced, looped): torch_xla
                 2.9 raises ModuleNotFoundError (jax) in its SPMD backward unless torch_xla[pallas] is installed
      shim_scan  gpt only: shim, the same (the trainer runs it without jax)
Prints one line RESULT {"compile_s": XLA's CompileTime over the first 3 steps (all graphs), "graphs": graphs
compiled then, "each_s": each one's compile seconds in order, "first3_s": seconds from the first step's start to the
third's end (tracing, compiles, runs), "step_s": median seconds of a steady step, "trace_s": of its tracing alone
(until the step's sync returns; the graph then runs), "loss"}. A process per run: SPMD
is one-way, and XLA's in-memory cache would hit. The same weights and batch in every mode of one workload and depth.
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

B, T, V = 8, 32, 256  # gpt
KD_B, KD_T, KD_V, KD_TEMP = 8, 64, 512, 2.0  # kd: the seeds' temperature


def gpt(depth, scan=False):
    from work_split import GPT  # the tests' nanoGPT, d=64

    torch.manual_seed(0)
    model = GPT(depth, scan=scan, seq=T, vocab=V)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(V, (B, T + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()
    return model, None, (x, y), lambda model, teacher, x, y: F.cross_entropy(model(x), y)


def qwen3(depth, seed, cache=True):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=KD_V, hidden_size=128, intermediate_size=256, num_hidden_layers=depth, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=KD_T, **({} if cache else {"use_cache": False}))
    return transformers.AutoModelForCausalLM.from_config(config)


def kd(depth, cache=True):
    import peft

    teacher = qwen3(depth, seed=1, cache=cache).eval().requires_grad_(False)
    student = peft.get_peft_model(qwen3(depth, seed=0, cache=cache), peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(KD_V, (KD_B, KD_T), generator=g)

    def loss_of(student, soft, ids, _):
        logp = F.log_softmax(student(input_ids=ids).logits.float() / KD_TEMP, dim=-1).flatten(0, 1)
        return F.kl_div(logp, soft, reduction="batchmean", log_target=True) * KD_TEMP ** 2

    return student, teacher, (ids, ids), loss_of


def teacher_targets(teacher, ids):
    with torch.no_grad():
        return F.log_softmax(teacher(input_ids=ids).logits.float() / KD_TEMP, dim=-1).flatten(0, 1)


def main(mode, depth, steps=10, workload="gpt"):
    import numpy as np

    if workload == "kd":
        model, teacher, batch, loss_of = kd(int(depth), cache=mode != "shim_no_cache")
    else:
        model, teacher, batch, loss_of = gpt(int(depth), scan=mode.endswith("scan"))
    import torch_xla

    cuts = {"seed": ("teacher", "backward"), "hand_cut": ("backward",)}.get(mode, ())  # the step's own cut follows

    def cut(where):
        if where in cuts:
            torch_xla.sync()

    if mode.startswith("shim"):
        import seamless_tpu as st

        trainer = st.SeamlessTPUTrainer(model, scan=mode != "shim_unrolled")
        if teacher is not None and mode == "shim_no_cache":
            st.SeamlessTPUTrainer(teacher)
        elif teacher is not None:  # as the seeds' script moves it: its layers loop too
            teacher.to(trainer.device)
        x, y = trainer.to_device(*batch)
        end_step = lambda: None  # noqa: E731  the trainer cuts the graph at the step
    else:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        device = torch_xla.device()
        n = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(n), (n,), ("data",))
        model.to(device)
        if teacher is not None:
            teacher.to(device)
        x, y = (t.to(device) for t in batch)
        for t in (x, y):
            xs.mark_sharding(t, mesh, ("data",) + (None,) * (t.dim() - 1))
        end_step = torch_xla.sync
    # made after the move (the new parameters), from the trainable ones (LoRA's adapters)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step():
        target = y
        if teacher is not None:
            target = teacher_targets(teacher, x)
            cut("teacher")
        optimizer.zero_grad()
        loss = loss_of(model, target, x, y)
        loss.backward()
        cut("backward")
        optimizer.step()
        end_step()
        return loss

    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    start = time.perf_counter()
    for _ in range(3):
        loss = step()
    xm.wait_device_ops()
    first3 = time.perf_counter() - start
    _, compile_ns, each = met.metric_data("CompileTime") or (0, 0, [])
    graphs = met.counter_value("UncachedCompile") or 0
    times, traced = [], []
    for _ in range(int(steps)):
        start = time.perf_counter()
        loss = step()
        traced.append(time.perf_counter() - start)
        xm.wait_device_ops()
        times.append(time.perf_counter() - start)
    print("RESULT " + json.dumps({"compile_s": compile_ns / 1e9, "graphs": graphs, "first3_s": first3,
                                  "each_s": [round(ns / 1e9, 2) for _, ns in each],
                                  "step_s": statistics.median(times), "trace_s": statistics.median(traced),
                                  "loss": float(loss.detach().cpu())}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
