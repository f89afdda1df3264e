"""Section memory: each device's peak under strategy="fsdp" against depth, from XLA's buffer assignment of the
partitioned programs (bench/memory_peak.py), for the trainer, torch_xla by hand, the ideal and issue 48's bound."""

import os

from harness import XLA_ENV, by_depth, mb, run_script

MEMORY_RUNS = {"mlp": (8, 16), "qwen3": (8, 16), "qwen3-small": (8, 16), "qwen3-remat": (8, 16),
               "flat": (24,), "cnn": (16,)}  # workload -> depths
MEMORY_WIDTHS = {"flat": ["2048"], "cnn": ["256"]}  # flat: 403 MB, issue 48's flat Sequential
MEMORY_MODES = ("shim", "hand", "unrolled")
UNLOOPED = ("flat", "cnn")  # no repeated block: the trainer's run is its unrolled one
BOUND_SLACK = 64e6  # issue 48's bound: 0.75x the model + 4 blocks + 64 MB per device


def run_memory(s):
    """bench/memory_peak.py per workload, depth and loop, each in its own process (a smoke run: a 2-block MLP of
    width 256)."""
    env = dict(os.environ, **XLA_ENV, SEAMLESS_TPU_DEVICE="xla")
    runs = ({("mlp", 2): ["256"]} if s.smoke else
            {(w, d): MEMORY_WIDTHS.get(w, []) for w, depths in MEMORY_RUNS.items() for d in depths})
    return {f"{w}/{d}/{mode}": run_script(["bench/memory_peak.py", mode, w, d, *extra], env, timeout=900)
            for (w, d), extra in runs.items() for mode in MEMORY_MODES if not (mode == "unrolled" and w in UNLOOPED)}


def render_memory(runs, s):
    md = ["Per device, on 4 XLA:CPU devices: the largest 'Total bytes used' of the step's programs in XLA's buffer "
          "assignment (the partitioned program's buffers: parameters, gradients, activations, temporaries), after 3 "
          "SGD steps with strategy=\"fsdp\". hand: torch_xla by hand, every parameter split on dim 0, one sync a step. "
          "ideal: the parameters' and gradients' shards (0.5x the model). bound: issue 48's 0.75x the model + 4 "
          "blocks + 64 MB. mlp: residual blocks of width 1024 (4x hidden), batch 16; qwen3: hidden 512, 8 x 128 "
          "tokens; qwen3-small: the same on 4 x 64 tokens (a quarter of the activations); qwen3-remat: qwen3 with "
          "gradient_checkpointing_enable(); flat: 24 (Linear(2048, 2048), LayerNorm) pairs, which stay unrolled, a "
          "Linear standing for a block; cnn: 16 (Conv2d(256, 256, 3), ReLU) pairs on 16 images of 8 x 8, unrolled "
          "too. unrolled: the trainer with scan=False (blocks one by one, each product gathering its weight in "
          "order; the same as the trainer's for flat and cnn). XLA's buffer assignment on a TPU may order buffers "
          "differently; nothing here measures that.", "",
          "| workload | blocks | model | trainer | trainer / model | unrolled / model | hand | hand / model | ideal | "
          "bound | trainer within bound |", "|---" * 11 + "|"]
    headline = []
    for key in by_depth(runs):
        shim, hand = runs[f"{key}/shim"], runs[f"{key}/hand"]
        unrolled = runs.get(f"{key}/unrolled", shim)
        model = shim["model_bytes"]
        bound = 0.75 * model + 4 * shim["block_bytes"] + BOUND_SLACK
        within = shim["peak_bytes"] <= bound
        workload, depth = key.split("/")
        md.append(f"| {workload} | {depth} | {mb(model)} | {mb(shim['peak_bytes'])} | "
                  f"{shim['peak_bytes'] / model:.2f} | {unrolled['peak_bytes'] / model:.2f} | "
                  f"{mb(hand['peak_bytes'])} | {hand['peak_bytes'] / model:.2f} | "
                  f"{mb(model / 2)} | {mb(bound)} | {'yes' if within else 'no'} |")
        headline.append(f"memory {key}: fsdp peak per device {shim['peak_bytes'] / model:.2f}x the model (unrolled "
                        f"{unrolled['peak_bytes'] / model:.2f}x, hand "
                        f"{hand['peak_bytes'] / model:.2f}x, ideal 0.50x, bound {bound / model:.2f}x)")
    return md, headline
