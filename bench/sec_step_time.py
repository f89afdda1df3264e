"""Sections xla_spmd, logging and eager_cpu: step time of each way of writing the loop against a baseline
(hand-written torch_xla, the shim's silent loop, plain PyTorch), on the MLP and the transformer, in interleaved
rounds with the baseline's A/A twin; the pooled ratios are judged against TARGETS."""

import random

from harness import AA, RUN_TABLE, compare, fmt, pooled, run_rows, verdict

TARGETS = {("xla_spmd_4dev", "shim"): 1.02, ("eager_cpu", "shim"): 1.01, ("xla_logging", "shim_log"): 1.02}  # at most
BASE_NAMES = {"handwritten_xla": "hand-written torch_xla", "plain": "plain PyTorch", "shim": "seamless_tpu ddp"}


def step_time(title, names, baseline, env, xla):
    """run() of a step-time comparison: both workloads, `names` against `baseline`."""

    def run(s):
        rng = random.Random(0)  # the order of variants in each round: a section alone draws as in a full run
        rows = []
        for workload in ("mlp", "transformer"):
            rows += compare(title, workload, names, baseline, env, s.warm, *s.block(workload, xla), s.repeats, rng)
        return {"rows": rows}

    return run


def render_step_time(result, s):
    rows = result["rows"]
    md = ["### Ratios, both runs' rounds pooled", "",
          "| comparison | workload | variant | ratio [95% interval] | A/A floor [95% interval] | target | verdict |",
          "|---|---|---|---|---|---|---|"]
    headline = []
    bases = {(r["comparison"], r["workload"]): r["variant"] for r in rows if r["baseline"]}
    for comparison, workload, variant in dict.fromkeys((r["comparison"], r["workload"], r["variant"]) for r in rows
                                                       if not r["baseline"] and not r["variant"].endswith(AA)):
        base = bases[comparison, workload]
        stats, floor = pooled(rows, comparison, workload, variant), pooled(rows, comparison, workload, base + AA)
        target = TARGETS.get((comparison, variant))
        # A smoke run's few rounds prove the code runs; they cannot judge a 2% target.
        judged = "no verdict (smoke)" if s.smoke and target else verdict(stats[1], stats[2], target)
        md.append(
            f"| {comparison} | {workload} | {variant} | {fmt(stats)} | {fmt(floor)} | "
            f"{'' if target is None else f'≤ {target}'} | {judged} |"
        )
        runs = [
            r["ratio"][0]
            for r in rows
            if (r["comparison"], r["workload"], r["variant"]) == (comparison, workload, variant)
        ]
        line = (f"{comparison} {workload}: {variant} / {BASE_NAMES[base]} = {fmt(stats)} "
                f"(runs {', '.join(f'{x:.3f}' for x in runs)}); A/A floor {fmt(floor)}")
        headline.append(line + (f"; target <= {target}: {judged}" if target else ""))
    transfers = {}
    for r in rows:
        if r["transfers_per_step"] is not None and not r["variant"].endswith(AA):
            transfers[r["variant"]] = max(transfers.get(r["variant"], 0.0), r["transfers_per_step"])
    if transfers:
        headline.append(
            "device->host transfers per steady step: " + ", ".join(f"{k} {v:.2f}" for k, v in transfers.items())
        )
    md += [
        "",
        "### Step time per run (ratio = median over rounds of variant block / baseline block)",
        "",
        *RUN_TABLE,
        *run_rows(rows),
    ]
    return md, headline
