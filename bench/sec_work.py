"""Section work: every device's share of the work (dot FLOPs, collective bytes, weights held) per model and
strategy, read by tests/work_split.py from the partitioned HLO of 3 AdamW steps on 4 XLA devices."""

import os

from harness import ROOT, TESTS_PATH, XLA_ENV, mb, run_script

WORK_MODELS = ["encoder", "encoder_seq_first", "gpt", "word_lm", "vit", "conv", "conv_bn", "qwen3", "folded"]


def run_work(s):
    """tests/work_split.py per model (each in its own process): 3 AdamW steps on 4 devices per strategy, read from
    the partitioned HLO of the last step graph. A smoke run reads two models."""
    path = os.pathsep.join([TESTS_PATH, os.path.join(ROOT, "bench")])  # work_split imports child and hlo
    env = dict(os.environ, **XLA_ENV, SEAMLESS_TPU_DEVICE="xla", PYTHONPATH=path)
    return {name: run_script(["tests/work_split.py", name], env, timeout=600)
            for name in (WORK_MODELS[:1] + ["word_lm"] if s.smoke else WORK_MODELS)}


def render_work(work, s):
    md = ["Per device and step, from the partitioned HLO (XLA:CPU here: these numbers carry over to a TPU, step "
          "times do not). dots: the step's dot FLOPs one device runs (0.25 = split 4 ways). Bytes are per device.",
          "", "| model | strategy | dots | all-gather | all-reduce | parameters | weights held |",
          "|---|---|---|---|---|---|---|"]
    headline = []
    for name, out in work.items():
        warned = [w for w in out.pop("warnings") if "run whole" in w]
        for layout, run in out.items():
            md.append(f"| {name} | {layout} | {run['dots']:.2f} | {mb(run['all_gather_bytes'])} | "
                      f"{mb(run['all_reduce_bytes'])} | {mb(run['param_bytes'])} | {run['device_share']:.2f} |")
        worst = max(run["dots"] for run in out.values())
        headline.append(f"work {name}: dots per device <= {worst:.2f}" + (f"; warned: {warned[0][:90]}" if warned
                                                                          else ""))
    return md, headline
