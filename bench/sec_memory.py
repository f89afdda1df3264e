"""Section memory: each device's peak under strategy="fsdp" against depth, from XLA's buffer assignment of the
partitioned programs (bench/memory_peak.py), for the trainer, torch_xla by hand, the ideal and issue 48's bound."""

import os

from harness import XLA_ENV, by_depth, mb, run_script

MEMORY_RUNS = {"mlp": (8, 16), "qwen3": (8, 16), "qwen3-small": (8, 16), "qwen3-remat": (8, 16),
               "flat": (24,)}  # workload -> depths
MEMORY_WIDTHS = {"flat": ["2048"]}  # 403 MB: issue 48's flat Sequential
MEMORY_MODES = ("shim", "hand")
BOUND_SLACK = 64e6  # issue 48's bound: 0.75x the model + 4 blocks + 64 MB per device


def run_memory(s):
    """bench/memory_peak.py per workload, depth and loop, each in its own process (a smoke run: a 2-block MLP of
    width 256)."""
    env = dict(os.environ, **XLA_ENV, SEAMLESS_TPU_DEVICE="xla")
    runs = ({("mlp", 2): ["256"]} if s.smoke else
            {(w, d): MEMORY_WIDTHS.get(w, []) for w, depths in MEMORY_RUNS.items() for d in depths})
    return {f"{w}/{d}/{mode}": run_script(["bench/memory_peak.py", mode, w, d, *extra], env, timeout=900)
            for (w, d), extra in runs.items() for mode in MEMORY_MODES}


def render_memory(runs, s):
    md = ["Per device, on 4 XLA:CPU devices: the largest 'Total bytes used' of the step's programs in XLA's buffer "
          "assignment (the partitioned program's buffers: parameters, gradients, activations, temporaries), after 3 "
          "SGD steps with strategy=\"fsdp\". hand: torch_xla by hand, every parameter split on dim 0, one sync a step. "
          "ideal: the parameters' and gradients' shards (0.5x the model). bound: issue 48's 0.75x the model + 4 "
          "blocks + 64 MB. mlp: residual blocks of width 1024 (4x hidden), batch 16; qwen3: hidden 512, 8 x 128 "
          "tokens; qwen3-small: the same on 4 x 64 tokens (a quarter of the activations); qwen3-remat: qwen3 with "
          "gradient_checkpointing_enable(); flat: 24 (Linear(2048, 2048), LayerNorm) pairs, which stay unrolled, a "
          "Linear standing for a block. XLA's buffer assignment on a TPU may order buffers differently; nothing here "
          "measures that.", "",
          "| workload | blocks | model | trainer | trainer / model | hand | hand / model | ideal | bound | "
          "trainer within bound |", "|---" * 10 + "|"]
    headline = []
    for key in by_depth(runs):
        shim, hand = runs[f"{key}/shim"], runs[f"{key}/hand"]
        model = shim["model_bytes"]
        bound = 0.75 * model + 4 * shim["block_bytes"] + BOUND_SLACK
        within = shim["peak_bytes"] <= bound
        workload, depth = key.split("/")
        md.append(f"| {workload} | {depth} | {mb(model)} | {mb(shim['peak_bytes'])} | "
                  f"{shim['peak_bytes'] / model:.2f} | {mb(hand['peak_bytes'])} | {hand['peak_bytes'] / model:.2f} | "
                  f"{mb(model / 2)} | {mb(bound)} | {'yes' if within else 'no'} |")
        headline.append(f"memory {key}: fsdp peak per device {shim['peak_bytes'] / model:.2f}x the model (hand "
                        f"{hand['peak_bytes'] / model:.2f}x, ideal 0.50x, bound {bound / model:.2f}x)")
    return md, headline
