"""Section fsdp: strategy='fsdp' against 'ddp' on XLA (4 devices, the transformer, AdamW): per-device parameter +
optimizer-state bytes (judged against FSDP_MEMORY_TARGET), step time in interleaved rounds, the collectives in
the compiled step, and the seconds and bytes of sharded and one-file checkpoints."""

import os
import random
import shutil
import statistics
import tempfile
import time

import hlo
from harness import AA, DUMP_HLO, RUN_TABLE, XLA_ENV, compare, fmt, mb, pooled, run_rows

FSDP = "xla_fsdp_vs_ddp"  # the comparison's title: strategy='fsdp' against 'ddp', both through the shim
FSDP_MEMORY_TARGET = 0.30  # per-device parameter + optimizer-state bytes, fsdp / ddp, at most


def tree_bytes(path):
    """(bytes, files) of a file, or of everything under a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path), 1
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files]
    return sum(sizes), len(sizes)


def checkpoint_cost(variant, reps):
    """Seconds and bytes of a sharded checkpoint (save_checkpoint / load_checkpoint) and of one
    consolidated file (trainer.save / torch.load + load_state_dict), `reps` times. Rep 0 runs the
    sharded pair first and is reported on its own (it pays one-time imports, e.g. of
    torch.distributed.checkpoint); later reps shuffle the two pairs. Every timed call ends with the
    device idle, so a lazy load is counted whole. After each load, one training step, untimed."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    model, optimizer, trainer, met = variant.model, variant.optimizer, variant.trainer, variant.metrics
    root = tempfile.mkdtemp(prefix="seamless_tpu_bench_")
    sharded, single = os.path.join(root, "sharded"), os.path.join(root, "single.pt")

    def load_single():
        state = torch.load(single, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    calls = {"save_checkpoint": lambda: trainer.save_checkpoint(sharded, model=model, optimizer=optimizer, epoch=0),
             "load_checkpoint": lambda: trainer.load_checkpoint(sharded, model=model, optimizer=optimizer),
             "save": lambda: trainer.save({"model": model, "optimizer": optimizer}, single),
             "torch.load + load_state_dict": load_single}
    pairs = [("save_checkpoint", "load_checkpoint"), ("save", "torch.load + load_state_dict")]
    times = {name: [] for name in calls}
    written, resume = {}, {}
    rng = random.Random(1)
    try:
        for rep in range(reps):
            for save, load in (pairs if rep == 0 else rng.sample(pairs, len(pairs))):
                for name in (save, load):
                    xm.wait_device_ops()
                    start = time.perf_counter()
                    calls[name]()
                    torch_xla.sync()  # loads leave lazy copies: they count until they are on the devices
                    xm.wait_device_ops()
                    times[name].append(time.perf_counter() - start)
                written[save] = tree_bytes(sharded if save == "save_checkpoint" else single)
                after_load = trainer.memory_stats(optimizer) if rep == 0 else None
                compiles = met.counter_value("UncachedCompile") or 0
                variant.step()  # fresh values on the devices for the next save
                if rep == 0:
                    resume[load] = {"after_load": after_load, "after_next_step": trainer.memory_stats(optimizer),
                                    "compiles_in_next_step": (met.counter_value("UncachedCompile") or 0) - compiles}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"seconds": times, "written": written, "resume": resume}


def fsdp_vs_ddp(warm, rounds, steps, repeats, checkpoint_reps, rng):
    """Issue 9: strategy='fsdp' against 'ddp', both through the shim, on XLA with 4 devices and the
    transformer. Step time in rounds (ddp is the baseline, with its A/A twin). Then the last run's
    ddp and fsdp workers, which dump the HLO they compile, count their per-device bytes and their
    step's collectives, and time checkpoints. Reusing them saves two start-ups and their compiles,
    most of a smoke run."""
    checkpoint = f"checkpoint {checkpoint_reps}"
    rows = compare(FSDP, "transformer", ["shim", "shim_fsdp"], "shim", dict(XLA_ENV, **{DUMP_HLO: "spmd"}),
                   warm, rounds, steps, repeats, rng, after=("profile", checkpoint))
    profiles = {
        r["variant"]: {**r["after"]["profile"], "checkpoint": r["after"][checkpoint]} for r in rows if r["after"]
    }
    return {"rows": rows, "profiles": profiles}


def run_fsdp(s):
    # XLA transformer blocks; checkpoint calls 5 times (2 in smoke)
    return fsdp_vs_ddp(s.warm, *s.block("transformer", True), s.repeats, 2 if s.smoke else 5, random.Random(0))


def fsdp_section(fsdp, s):
    """Markdown lines of the fsdp-vs-ddp section, and its headline lines."""
    rows, profiles = fsdp["rows"], fsdp["profiles"]
    strategies = {"ddp": profiles["shim"], "fsdp": profiles["shim_fsdp"]}
    per_device = {k: max(p["bytes"]["per_device"]) for k, p in strategies.items()}
    ratio = per_device["fsdp"] / per_device["ddp"]
    judged = "met" if ratio <= FSDP_MEMORY_TARGET else "missed"  # a count of bytes, not a timing: no interval
    md = [
        "Both through `SeamlessTPUTrainer(model, strategy=...)`, the optimizer made before the trainer, the plain "
        "loop.",
        "",
        "### Parameter + optimizer-state bytes per device (after the timed rounds; "
        "`trainer.memory_stats(optimizer)`, "
        "counted from the shapes of each tensor's shards)",
        "",
        "| strategy | bytes on each device | one whole replica | per device / replica |",
        "|---|---|---|---|",
    ]
    for k, p in strategies.items():
        b = p["bytes"]
        cells = (
            f"{len(b['per_device'])} × {b['per_device'][0]:,}"
            if len(set(b["per_device"])) == 1
            else ", ".join(f"{x:,}" for x in b["per_device"])
        )
        md.append(f"| {k} | {cells} | {b['replica']:,} | {max(b['per_device']) / b['replica']:.3f} |")
    memory = (
        f"fsdp / ddp per-device parameter + AdamW-state bytes = {ratio:.3f}; target <= {FSDP_MEMORY_TARGET}: {judged}"
    )
    md += ["", f"- {memory} (an exact count, no interval)"]

    stats, floor = pooled(rows, FSDP, "transformer", "shim_fsdp"), pooled(rows, FSDP, "transformer", "shim" + AA)
    runs = [r["ratio"][0] for r in rows if r["variant"] == "shim_fsdp"]
    step = (f"xla transformer step: fsdp / ddp = {fmt(stats)} (runs {', '.join(f'{x:.3f}' for x in runs)}); "
            f"A/A floor {fmt(floor)}; report only (no target)")
    md += ["", "### Step time, fsdp / ddp (same rounds method; ddp is the baseline, with its A/A twin)", "",
           f"- {step}", "", *RUN_TABLE, *run_rows(rows)]

    ops = [
        op
        for op in (hlo.COLLECTIVES[0], hlo.PARAM_GATHER, *hlo.COLLECTIVES[1:])
        if any(op in p["collectives"] for p in strategies.values())
    ]
    md += ["", "### Collectives in the compiled steady-state step (count, result bytes on one device)", "",
           "From the partitioned, optimized HLO that XLA:CPU dumps (`--xla_dump_to`). The partitioner (GSPMD) is the "
           "one TPUs use; "
           "a TPU backend may still combine or rewrite collectives differently.", ""]
    if ops:
        md += ["| strategy | " + " | ".join(ops) + " | all |", "|---" * (len(ops) + 2) + "|"]
        for k, p in strategies.items():
            c = p["collectives"]
            cells = [f"{c[op][0]} ({mb(c[op][1])})" if op in c else "0" for op in ops]
            total = [
                v for op, v in c.items() if op in hlo.COLLECTIVES
            ]  # PARAM_GATHER is part of all-gather: not added twice
            md.append(
                f"| {k} | " + " | ".join(cells) + f" | {sum(n for n, _ in total)} ({mb(sum(b for _, b in total))}) |"
            )
    else:
        md.append("- no HLO dump was found")
    gathers = {k: (p["collectives"].get("all-gather", (0, 0)), p["collectives"].get(hlo.PARAM_GATHER, (0, 0)))
               for k, p in strategies.items()}
    collectives = "all-gathers per step (count, MB per device; of which a parameter's shape): " + ", ".join(
        f"{k} {n}, {b / 1e6:.1f} ({pn}, {pb / 1e6:.3f})" for k, ((n, b), (pn, pb)) in gathers.items()
    )

    md += ["", "### Checkpoints (one process holds all 4 devices, so bytes per process = bytes written)", "",
           "| strategy | call | first call s | median s [min–max] of the other calls | bytes written | files "
           "|", "|---|---|---|---|---|---|"]
    for k, p in strategies.items():
        ck = p["checkpoint"]
        for call, secs in ck["seconds"].items():
            rest = secs[1:] or secs
            size, files = ck["written"].get(call, ("", ""))
            md.append(
                f"| {k} | `{call}` | {secs[0]:.3f} | {statistics.median(rest):.3f} [{min(rest):.3f}–{max(rest):.3f}] "
                f"({len(rest)}) | "
                f"{'' if size == '' else f'{size:,}'} | {files} |"
            )
    md += ["", "After the first load of each kind, per-device bytes (as above) and the next training step. The sharded "
           "checkpoint is loaded first, so the step after the one-file load may find its graph compiled already.", ""]
    for k, p in strategies.items():
        for call, r in p["checkpoint"]["resume"].items():
            replica = r["after_load"]["replica"]
            md.append(
                f"- {k}, right after `{call}`: {max(r['after_load']['per_device']) / replica:.3f} of a replica per "
                "device; "
                f"after the next step {max(r['after_next_step']['per_device']) / replica:.3f}; that step "
                "compiled "
                f"{r['compiles_in_next_step']} new graph(s)"
            )
    ck = strategies["fsdp"]["checkpoint"]
    med = {call: statistics.median(secs[1:] or secs) for call, secs in ck["seconds"].items()}
    checkpoint = (
        f"fsdp checkpoints (median s): save_checkpoint {med['save_checkpoint']:.3f} "
        f"({mb(ck['written']['save_checkpoint'][0])} in "
        f"{ck['written']['save_checkpoint'][1]} files), load_checkpoint {med['load_checkpoint']:.3f}; "
        "trainer.save "
        f"{med['save']:.3f} ({mb(ck['written']['save'][0])}, 1 file), torch.load + load_state_dict "
        f"{med['torch.load + load_state_dict']:.3f}"
    )
    return md, [memory, step, collectives, checkpoint]
