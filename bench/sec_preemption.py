"""Section preemption: what the preemption hook's agreement costs per step on 2 gloo ranks (CPU), on as shipped,
at every step and off, in interleaved blocks with an A/A twin."""

import os
import random
import statistics
import subprocess
import sys
import time

from harness import AA, BENCH, ROOT, THREADS, interval, report, result


def preemption_rank(rounds, steps):
    """One of 2 gloo ranks: a DDP MLP through the trainer, timed in blocks of `steps` with the real preemption
    hook on (as shipped: an agreement every AGREE_EVERY_S, at most AGREE_MAX_STEPS apart), on with an agreement
    at every step, off (its handle removed), and on again as an A/A twin, in an order drawn per round from a seed
    both ranks share (their collectives must match). Prints, on rank 0, {variant: [s per step, a block per round]}."""
    import torch

    import seamless_tpu as st

    rounds, steps = int(rounds), int(steps)
    torch.set_num_threads(THREADS)
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    x, y = torch.randn(32, 64), torch.randn(32, 1)

    shipped = st.AGREE_MAX_STEPS

    def block(name):
        # off: the post-step hook skips preemption's part, as in a process with no SIGTERM handler of ours
        st._STATE.preemption.watching, st.AGREE_MAX_STEPS = name != "off", 1 if name == "every step" else shipped
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(trainer.model(x), y).backward()
            optimizer.step()
        return (time.perf_counter() - start) / steps

    rng, times = random.Random(0), {"on": [], "every step": [], "off": [], "on" + AA: []}
    block("on"), block("off")  # warm-up
    for _ in range(rounds):
        for name in rng.sample(list(times), len(times)):
            times[name].append(block(name))
    if torch.distributed.get_rank() == 0:
        report(times)
    torch.distributed.destroy_process_group()


def run_preemption(s):
    rounds, steps = (3, 20) if s.smoke else (40, 100)
    port = random.Random().randrange(20000, 40000)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", USE_TORCH_XLA="0")
    procs = [
        subprocess.Popen(
            [sys.executable, BENCH, "--child", "preemption-rank", str(rounds), str(steps)],
            cwd=ROOT,
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("the preemption ranks failed:\n" + "\n".join(err[-2000:] for _, err in outs))
    return result(outs[0][0], "preemption rank 0")


def render_preemption(times, s):
    ratios = {name: [a / b for a, b in zip(times[name], times["off"])] for name in times if name != "off"}
    floor = [a / b for a, b in zip(times["on" + AA], times["on"])]
    extra = statistics.median(times["on"]) - statistics.median(times["off"])
    md = ["2 gloo ranks (CPU), a DDP MLP (64-256-1, batch 32) through the trainer; the preemption hook's real "
          "post-step work on (as shipped: the ranks agree about every 0.25 s, at most 16 steps apart), on with an "
          "agreement at every step, or off, in blocks drawn in a random order each round; A/A: on, twice.", "",
          "| | median s/step | ratio to off [95% interval] |", "|---|---|---|"]
    md += [f"| hook {name} | {statistics.median(times[name]) * 1e6:.0f} us | "
           + ("{:.3f} [{:.3f}, {:.3f}] |".format(*interval(ratios[name]))
              if name in ratios else "1 |") for name in times]
    md += ["", "- A/A floor (on twice): {:.3f} [{:.3f}, {:.3f}]; ".format(*interval(floor)) +
           f"the hook costs {extra * 1e6:+.0f} us per step (median on - median off)"]
    return md, [f"preemption agreement on 2 gloo ranks: {statistics.median(ratios['on']):.3f} of the step without it "
                f"(A/A {statistics.median(floor):.3f}; every step: {statistics.median(ratios['every step']):.3f}), "
                f"{extra * 1e6:+.0f} us per step"]
