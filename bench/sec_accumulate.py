"""Section accumulate: gradient accumulation on XLA, compile seconds and graphs of tests/loops.py for k backwards
per step (ratio to k=1), and the iteration rule's own cost per forward and per parameter per backward."""

import os
import statistics
import time

from harness import TESTS_PATH, XLA_ENV, report, run_child, run_script


def run_accumulate(s):
    """Compile seconds and graph counts of tests/loops.py accumulate K (8-layer MLP, AdamW) for K in 1, 4,
    16 (1 and 16 in a smoke run), each in fresh processes, alternating; and the iteration rule's own cost
    per forward and per parameter per backward, timed in isolation."""
    env = dict(os.environ, **XLA_ENV, SEAMLESS_TPU_DEVICE="xla", PYTHONPATH=TESTS_PATH)
    runs = {(loop, k): [] for loop in ("accumulate", "accumulate_lm") for k in ((1, 16) if s.smoke else (1, 4, 16))}
    for _ in range(1 if s.smoke else 3):
        for loop, k in runs:
            runs[loop, k].append(run_script(["tests/loops.py", loop, k], env))
    forward_us, backward_us = run_child("rule-cost", env=env)
    return {
        "runs": [[loop, k, rs] for (loop, k), rs in runs.items()],
        "forward_us": forward_us,
        "per_param_backward_us": backward_us,
    }


def rule_cost_child():
    """Microseconds the iteration rule costs per forward (the common path: nothing to cut) and per parameter
    per backward, each hook timed alone on an 8-layer MLP on XLA."""
    import torch

    import seamless_tpu as st

    st.get_device()
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
    st.SeamlessTPUTrainer(model)
    param, n = next(model.parameters()), 200000
    start = time.perf_counter()
    for _ in range(n):
        st._before_forward(model, (), {})
    forward = (time.perf_counter() - start) / n
    st._STATE.cuts.no_grad_forward = False
    start = time.perf_counter()
    for _ in range(n):
        st._saw_backward(param)
    report([forward * 1e6, (time.perf_counter() - start) / n * 1e6])


def render_accumulate(result, s):
    runs = {(loop, k): rs for loop, k, rs in result["runs"]}
    md = [
        "| model | k (backwards per step) | graphs compiled | device->host reads per step | compile s (median) | "
        "ratio to k=1 |",
        "|---|---|---|---|---|---|",
    ]
    ratios = {}
    for (loop, k), rs in runs.items():
        median, base = (statistics.median(r["compile_s"] for r in runs[loop, n]) for n in (k, 1))
        reads = rs[0]["transfers"][-1] - rs[0]["transfers"][-2]
        name = "tiny Qwen3 LM (transformers)" if loop == "accumulate_lm" else "8-layer MLP"
        md.append(f"| {name} | {k} | {rs[0]['compiles'][-1]} | {reads} | {median:.2f} | {median / base:.2f} |")
        ratios[loop] = median / base
    line = (f"accumulation compile time k=16 / k=1: MLP {ratios['accumulate']:.2f}, LM {ratios['accumulate_lm']:.2f} "
            f"({len(runs['accumulate', 1])} run(s) each; target 1.5); the iteration rule costs "
            f"{result['forward_us']:.2f} us per "
            f"forward and {result['per_param_backward_us']:.2f} us per parameter per backward")
    return md + ["", f"- {line}"], [line]
