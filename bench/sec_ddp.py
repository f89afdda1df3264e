"""Section ddp: DDP through the trainer against torch's composable replicate() and DistributedDataParallel with
its defaults (twice: A/A) on 2 gloo ranks, on the CPU and, where CUDA is present, sharing GPU 0."""

import os
import random
import statistics
import subprocess
import sys
import time

from harness import AA, BENCH, ROOT, THREADS, interval, report, result


def ddp_rank(rounds, steps, device):
    """One of 2 gloo ranks on `device` (cpu, or cuda: both ranks on GPU 0): the same MLP (64-512-512-1, batch 32,
    AdamW) in DDP through the trainer, in torch's composable replicate() (what the trainer applies) and in torch's
    DistributedDataParallel with its defaults twice (the A/A floor), timed in blocks of `steps` in an order drawn
    per round from a seed both ranks share. The trainer's preemption hook is off: this compares the DDP wrappers.
    Prints, on rank 0, {variant: [s per step]} and find_unused_parameters of the trainer's DDP after its first step.
    """
    import torch
    from torch.distributed._composable.replicate import replicate

    import seamless_tpu as st

    rounds, steps = int(rounds), int(steps)
    torch.set_num_threads(THREADS)
    torch.distributed.init_process_group("gloo")
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                   torch.nn.ReLU(), torch.nn.Linear(512, 1))

    shim = mlp()
    st.SeamlessTPUTrainer(shim, device=str(dev))
    st._STATE.preemption.watching = False  # DDP alone is timed: no SIGTERM agreement
    models = {"trainer": shim}
    for name in ("torch DDP", "torch DDP" + AA):
        models[name] = torch.nn.parallel.DistributedDataParallel(
            mlp().to(dev), device_ids=[0] if dev.type == "cuda" else None)
    models["torch replicate()"] = replicate(mlp().to(dev), device_id=dev)  # the composable DDP the trainer applies
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    x, y = torch.randn(32, 64, device=dev), torch.randn(32, 1, device=dev)

    def block(name):
        model, optimizer = models[name], optimizers[name]
        torch.distributed.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    for name in models:  # warm-up, and the trainer's first step reads which parameters the ranks use
        block(name)
    rng, times = random.Random(0), {name: [] for name in models}
    for _ in range(rounds):
        for name in rng.sample(list(times), len(times)):
            times[name].append(block(name))
    found = replicate.state(shim)._ddp.find_unused_parameters
    if torch.distributed.get_rank() == 0:
        report({"times": times, "find_unused": found})
    torch.distributed.destroy_process_group()


def run_ddp(s):
    """ddp_rank on 2 gloo CPU ranks, and on 2 ranks sharing GPU 0 where CUDA is present."""
    import torch

    rounds, steps = (2, 10) if s.smoke else (30, 50)
    out = {}
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        port = random.Random().randrange(20000, 40000)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", USE_TORCH_XLA="0")
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        procs = [subprocess.Popen([sys.executable, BENCH, "--child", "ddp-rank", str(rounds),
                                   str(steps), device], cwd=ROOT, env=dict(env, RANK=str(rank)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        outs = [p.communicate(timeout=600) for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("the ddp ranks failed:\n" + "\n".join(err[-2000:] for _, err in outs))
        out[device] = result(outs[0][0], "ddp rank 0")
        out[device]["warned"] = sum("find_unused_parameters=True was specified" in err for _, err in outs)
    return out


def render_ddp(out, s):
    md = ["2 gloo ranks, an MLP (64-512-512-1, batch 32, AdamW): DDP through the trainer (torch's composable "
          "replicate; find_unused_parameters off unless a rank leaves a parameter out at the first step) against "
          "torch's composable replicate() alone and torch's DistributedDataParallel with its defaults, twice (A/A), "
          "in blocks drawn in a random order each round. The trainer's preemption hook is off.", "",
          "| device | variant | median s/step | ratio to torch DDP [95% interval] |", "|---|---|---|---|"]
    lines = []
    for device, r in out.items():
        times, base = r["times"], r["times"]["torch DDP"]
        for name in times:
            ratios = [a / b for a, b in zip(times[name], base)]
            cell = "1" if name == "torch DDP" else "{:.3f} [{:.3f}, {:.3f}]".format(*interval(ratios))
            md.append(f"| {device} | {name} | {statistics.median(times[name]) * 1e6:.0f} us | {cell} |")
        ratio = statistics.median(a / b for a, b in zip(times["trainer"], base))
        floor = statistics.median(a / b for a, b in zip(times["torch DDP" + AA], base))
        lines.append(f"DDP on 2 gloo ranks ({device}): trainer / torch DDP {ratio:.3f} (A/A {floor:.3f}); "
                     f"find_unused_parameters {r['find_unused']}; ranks that printed torch's find_unused warning: "
                     f"{r['warned']}")
    return md + [""] + [f"- {line}" for line in lines], lines
