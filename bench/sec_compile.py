"""Section compile: first-run compile time against depth on XLA (4 devices), bench/compile_depth.py's loops (an
SDPA GPT; the seeds' LoRA distillation) each in a fresh process: compile seconds, graphs, the first 3 steps and
the steady step, as ratios to the hand-written one-sync loop."""

import os
import random
import statistics

from harness import XLA_ENV, by_depth, run_script


# bench/compile_depth.py's loops per workload: shim runs repeated blocks as one loop (issue 48), shim_unrolled does not
# (scan=False), shim_scan is torch_xla's scan_layers by hand. Not hand_scan: torch_xla 2.9's scan backward under SPMD
# imports jax (shard_as), which torch_xla[pallas] brings and this environment has not; the trainer runs it
COMPILE_MODES = {"gpt": ("hand", "shim", "shim_unrolled", "shim_scan"),
                 "kd": ("seed", "hand", "shim_unrolled", "shim", "shim_no_cache")}
COMPILE_DEPTHS = {"gpt": (2, 8, 24), "kd": (4, 28, 56)}


def run_compile(s):
    """bench/compile_depth.py: an SDPA GPT at 2, 8 and 24 blocks, and the seeds' workload (a Qwen3 + LoRA student,
    a frozen teacher, KL divergence) at 4, 28 and 56 layers (2 and 1 in a smoke run), each loop in a fresh process, the
    loops in a random order per round, 3 rounds: XLA's compile seconds and graphs over the first 3 steps, the time
    to the end of step 3, and the steady step."""
    env = dict(os.environ, **XLA_ENV, SEAMLESS_TPU_DEVICE="xla")
    rng, runs = random.Random(0), {}
    for workload, modes in COMPILE_MODES.items():
        for depth in ({"gpt": 2, "kd": 1}[workload],) if s.smoke else COMPILE_DEPTHS[workload]:
            for _ in range(1 if s.smoke else 3):
                for mode in rng.sample(modes, len(modes)):
                    args = ["bench/compile_depth.py", mode, depth, 3 if s.smoke else 10, workload]
                    runs.setdefault(f"{workload}/{depth}/{mode}", []).append(run_script(args, env, timeout=900))
    return runs


def render_compile(runs, s):
    md = ["Compile seconds: XLA's CompileTime over the first 3 steps, all graphs; first 3 steps: wall seconds from the "
          "first step's start to the third's end; step: the steady step, and its tracing alone (until the step's "
          "sync returns: the Python side, the lowerings' included; the graph then runs). Ratios to the hand-written "
          "one-sync loop of the same round; [min, max] over the rounds. gpt: an SDPA GPT of that many blocks; kd: the "
          "seeds' workload (a Qwen3 student of that many layers with LoRA on q/k/v/o, a frozen teacher, F.kl_div at "
          "T=2); seed: their loop, a sync after the teacher's forward, the backward and the step.", "",
          "| workload | depth | loop | graphs | compile s (median) | compile / hand [min, max] | first 3 steps s | "
          "step ms (median) | step / hand [min, max] | tracing ms (median) |", "|---" * 10 + "|"]
    headline = []
    for key in by_depth(runs):
        workload, depth = key.split("/")
        hand = runs[f"{key}/hand"]
        for mode in COMPILE_MODES[workload]:
            rs = runs[f"{key}/{mode}"]
            ratios = [r["compile_s"] / h["compile_s"] for r, h in zip(rs, hand)]
            steps = [r["step_s"] / h["step_s"] for r, h in zip(rs, hand)]
            md.append(f"| {workload} | {depth} | {mode} | {rs[0]['graphs']} | "
                      f"{statistics.median(r['compile_s'] for r in rs):.1f} | "
                      f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] | "
                      f"{statistics.median(r['first3_s'] for r in rs):.1f} | "
                      f"{statistics.median(r['step_s'] for r in rs) * 1e3:.0f} | {statistics.median(steps):.2f} "
                      f"[{min(steps):.2f}, {max(steps):.2f}] | "
                      f"{statistics.median(r['trace_s'] for r in rs) * 1e3:.0f} |")
            if mode == "shim":
                line = (f"compile {workload} {depth}: shim / hand {statistics.median(ratios):.2f} "
                        f"[{min(ratios):.2f}, {max(ratios):.2f}] (steady step {statistics.median(steps):.2f})")
                if workload == "kd":
                    seed = [r["compile_s"] / e["compile_s"] for r, e in zip(rs, runs[f"{key}/seed"])]
                    line += f", shim / seed {statistics.median(seed):.2f} [{min(seed):.2f}, {max(seed):.2f}]"
                    shallow = runs.get(f"kd/{min(COMPILE_DEPTHS['kd'])}/shim")  # issue 61: its growth with depth
                    if shallow and shallow is not rs:
                        grew = statistics.median(r["compile_s"] for r in rs) / statistics.median(
                            r["compile_s"] for r in shallow)
                        line += f", {grew:.2f}x its {min(COMPILE_DEPTHS['kd'])}-layer compile"
                headline.append(line)
    return md + [""] + [f"- {line}" for line in headline], headline
