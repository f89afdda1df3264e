"""Section tp: ddp, fsdp, tensor parallelism and 2-D on XLA (4 devices, a tiny transformers Qwen3 with its own
TP plan): per-device bytes, the dot FLOPs one device holds, the step's collectives, and step time against ddp."""

import random

import hlo
from harness import AA, DUMP_HLO, RUN_TABLE, TP_VARIANTS, XLA_ENV, compare, fmt, mb, pooled, run_rows

TP = "xla_tensor_parallel"  # the comparison's title: ddp, fsdp, tensor parallel and 2-D on a transformers LM
TP_NAMES = {"shim": "ddp (4,) data", "shim_fsdp": "fsdp (4,) fsdp", "shim_tp": "tensor parallel (1, 4) data x model",
            "shim_2d": "2-D (2, 2) fsdp x model"}


def tensor_parallel(warm, rounds, steps, repeats, rng):
    """ddp, fsdp, tensor parallel and 2-D on XLA with 4 devices and the transformers LM (its own plan):
    step time in rounds (ddp is the baseline, with its A/A twin); then each worker's per-device bytes,
    the dot FLOPs one device holds (from the HLO around the SPMD partitioner) and its step's collectives."""
    rows = compare(
        TP,
        "lm",
        list(TP_VARIANTS),
        "shim",
        dict(XLA_ENV, **{DUMP_HLO: "spmd"}),
        warm,
        rounds,
        steps,
        repeats,
        rng,
        after=("profile",),
    )
    return {"rows": rows, "profiles": {r["variant"]: r["after"]["profile"] for r in rows if r["after"]}}


def run_tp(s):
    return tensor_parallel(s.warm, *s.block("transformer", True), s.repeats, random.Random(0))


def tp_section(tp, s):
    """Markdown lines of the tensor-parallel section, and its headline lines."""
    rows, profiles = tp["rows"], tp["profiles"]
    md = [
        "All through `SeamlessTPUTrainer(model, ...)` with the plain loop and AdamW; the tensor-parallel variants "
        "use the "
        "model's own plan (`config.base_model_tp_plan` and the head's). A tiny Qwen3 (4 layers, hidden 256, vocab "
        "2048), "
        "batch 8 x 128 tokens.",
        "",
        "| variant | params + AdamW bytes per device / replica | dot FLOPs on one device / whole step | step time "
        "/ ddp [95% interval] |",
        "|---|---|---|---|",
    ]
    floor = pooled(rows, TP, "lm", "shim" + AA)
    headline = []
    for name in TP_VARIANTS:
        p = profiles[name]
        memory = max(p["bytes"]["per_device"]) / p["bytes"]["replica"]
        dots = "" if not p.get("dot_flops") else f"{p['dot_flops'][2]:.3f}"
        step = "1 (baseline)" if name == "shim" else fmt(pooled(rows, TP, "lm", name))
        md.append(f"| {TP_NAMES[name]} | {memory:.3f} | {dots} | {step} |")
        headline.append(
            f"{TP_NAMES[name]}: {memory:.3f} of the bytes, {dots or '?'} of the dot FLOPs per device, step {step}"
        )
    md += [
        "",
        f"- A/A floor (ddp against itself): {fmt(floor)}. Step times on XLA:CPU, where collectives are memory copies: "
        "they say nothing about a TPU's interconnect; report only.",
        "",
        "### Collectives in the compiled steady-state step (count, result bytes on one device)",
        "",
    ]
    ops = [op for op in hlo.COLLECTIVES if any(op in p["collectives"] for p in profiles.values())]
    if ops:
        md += ["| variant | " + " | ".join(ops) + " |", "|---" * (len(ops) + 1) + "|"]
        for name in TP_VARIANTS:
            c = profiles[name]["collectives"]
            md.append(
                f"| {TP_NAMES[name]} | "
                + " | ".join(f"{c[op][0]} ({mb(c[op][1])})" if op in c else "0" for op in ops)
                + " |"
            )
    md += ["", *RUN_TABLE, *run_rows(rows)]
    return md, headline
