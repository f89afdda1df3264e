"""What seamless_tpu costs, measured side by side in one run, with how much the run can resolve.

    ./dev.sh bench                      # every section: writes bench/RESULTS.md and bench/step_times.png
    ./dev.sh bench --smoke [--jobs 2]   # a few steps of every section (CI: 2 sections at once); writes nothing
                                        # unless --out is given
    ./dev.sh bench --only NAME [NAME..] [--out F]   # those sections alone (SECTIONS below: xla_spmd,
                                        # logging, eager_cpu, compiles, overhead, imports, ray, fsdp, compile,
                                        # accumulate, checkpoints, preemption, ddp, tp, work, memory); writes
                                        # nothing unless --out is given

RESULTS.md holds one block per section (between <!-- bench:NAME --> and <!-- /bench:NAME -->), whose
first line names the commit it ran at and the command that runs it alone. A write to --out replaces
the blocks of the sections that ran (a full run: all of them, and the header) and keeps the others
as they were, with their own commit lines, and the hand-written text after the blocks (Findings).

Every variant lives in its own worker process (the shim installs global optimizer hooks that
must not touch the hand-written loop; accelerate and Fabric keep process-wide state). After
warm-up the driver runs rounds: in each round every variant runs one short block of steps, in a
random order, with torch.set_num_threads pinned the same everywhere, so a burst of load hits
every variant alike. Each comparison also runs its baseline twice, as two independent workers
(the A/A control): their ratio, ideally 1.000, is the noise floor of that run. A ratio is the
median over rounds of (variant block / baseline block, same round), with a 95% bootstrap
interval over rounds; a target counts as met only when the whole interval is under it. Every
comparison runs twice (run 1, run 2), in fresh processes.

The code: this file is the entry point (the command line, the SECTIONS and CHILDREN tables, the line
protocol a worker answers, the RESULTS.md writer); bench/harness.py holds what the sections share (paths,
child processes, the interleaved rounds, the write-up's pieces); bench/workers.py what a worker process
steps; bench/sec_*.py one section each (sec_step_time.py the three step-time ones): its run, its
write-up and the worker or child functions only it uses.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import harness  # first: it puts the repository root (seamless_tpu) and tests/ (child.py) on the path
from harness import DUMP_HLO, EAGER_ENV, ROOT, XLA_ENV, Section, Settings, chart, child, header
from sec_accumulate import render_accumulate, rule_cost_child, run_accumulate
from sec_checkpoints import gpu_saves_child, render_checkpoints, run_checkpoints, save_while_training_child
from sec_compile import render_compile, run_compile
from sec_compiles import compiles_over_epochs, render_compiles, run_compiles
from sec_ddp import ddp_rank, render_ddp, run_ddp
from sec_fsdp import checkpoint_cost, fsdp_section, run_fsdp
from sec_imports import import_child, import_cost, render_imports
from sec_memory import render_memory, run_memory
from sec_overhead import render_overhead, run_overhead, shim_overhead
from sec_preemption import preemption_rank, render_preemption, run_preemption
from sec_ray import ray_fit_child, ray_fit_times, render_ray
from sec_step_time import render_step_time, step_time
from sec_tp import run_tp, tp_section
from sec_work import render_work, run_work
from workers import Variant, profile


# --- worker side: one variant, one workload (bench/workers.py), answering the driver -----------------


def worker_main(name, workload):
    """Line protocol on stdin/stdout: 'warm N', 'run N' (-> seconds and counter deltas), 'compiles',
    'overhead', 'profile', 'checkpoint N', 'quit'."""
    dump = None
    if os.environ.get(DUMP_HLO):  # before torch_xla starts: XLA reads XLA_FLAGS once
        dump = tempfile.mkdtemp(prefix="seamless_tpu_hlo_")
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
        if os.environ[DUMP_HLO] == "spmd":  # also the graph around the SPMD partitioner: dot FLOPs per device
            flags += " --xla_dump_hlo_pass_re=spmd-partitioning"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    try:
        serve(name, workload, dump)
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)


def serve(name, workload, dump):
    variant = None
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not corrupt the protocol
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "quit":
            break
        if cmd == "compiles":
            reply = {"counts": compiles_over_epochs(name)}
        elif cmd == "overhead":
            variant = variant or Variant(name, workload)
            reply = shim_overhead(variant)
        elif cmd == "profile":
            variant = variant or Variant(name, workload)
            reply = profile(variant, dump)
        elif cmd == "checkpoint":
            variant = variant or Variant(name, workload)
            reply = checkpoint_cost(variant, int(arg[0]))
        else:
            variant = variant or Variant(name, workload)
            n = int(arg[0])
            before = variant.counters()
            variant.wait()
            start = time.perf_counter()
            for _ in range(n):
                variant.step()
            variant.wait()
            seconds = time.perf_counter() - start
            after = variant.counters()
            reply = {"step_s": seconds / n, "delta": {k: after[k] - before[k] for k in after}}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# --- sections: each comparison, runnable alone (--only NAME), and how it is written up ---------------


CHILDREN = {"import": import_child, "ray-fit": ray_fit_child, "rule-cost": rule_cost_child,  # --child NAME ARGS
            "save-while-training": save_while_training_child, "preemption-rank": preemption_rank,
            "ddp-rank": ddp_rank, "gpu-saves": gpu_saves_child}


SECTIONS = {  # the order of a full run and of RESULTS.md
    "xla_spmd": Section(
        "XLA SPMD on 4 devices: seamless_tpu vs hand-written torch_xla, step time",
        step_time("xla_spmd_4dev", ["handwritten_xla", "shim"], "handwritten_xla", XLA_ENV, xla=True),
        render_step_time,
        charted=True,
    ),
    "logging": Section(
        "Logging the loss every step on XLA (4 devices): trainer.log and loss.item() vs a silent loop, step time",
        step_time("xla_logging", ["shim", "shim_log", "shim_item"], "shim", XLA_ENV, xla=True),
        render_step_time,
    ),
    "eager_cpu": Section(
        "Eager CPU: seamless_tpu, accelerate and Fabric vs plain PyTorch, step time",
        step_time("eager_cpu", ["plain", "shim", "accelerate", "fabric"], "plain", EAGER_ENV, xla=False),
        render_step_time,
        charted=True,
    ),
    "compiles": Section(
        "Compilations over 3 epochs (70 samples, batch 8: the last batch has 6)", run_compiles, render_compiles
    ),
    "overhead": Section("The shim's own work per step (timed in isolation)", run_overhead, render_overhead),
    "imports": Section(
        "Import cost after torch (fresh interpreters, ms)", lambda s: import_cost(3 if s.smoke else 7), render_imports
    ),
    "ray": Section(
        "Ray Train: 2-worker CPU fit (s), random order per round, stock gloo twice (A/A)",
        lambda s: ray_fit_times(1 if s.smoke else 3, random.Random(0), twin=not s.smoke),
        render_ray,
    ),
    "fsdp": Section(
        "strategy='fsdp' vs 'ddp' on XLA (4 devices, transformer, AdamW)", run_fsdp, fsdp_section, charted=True
    ),
    "compile": Section(
        "First-run compile time against depth on XLA (4 devices): an SDPA GPT (the shim, the hand-written loop, "
        "torch_xla's scan_layers) and the seeds' LoRA distillation (their own loop too)", run_compile, render_compile,
    ),
    "accumulate": Section(
        "Gradient accumulation on XLA: compile time against k (ratio to k=1)", run_accumulate, render_accumulate
    ),
    "checkpoints": Section(
        "Checkpoints on XLA: load cost, step time during an async save, SIGTERM to a saved exit",
        run_checkpoints,
        render_checkpoints,
    ),
    "preemption": Section(
        "Preemption agreement per step on 2 gloo ranks (A/A method)", run_preemption, render_preemption
    ),
    "ddp": Section("DDP on 2 gloo ranks: the trainer's against torch's defaults (A/A method)", run_ddp, render_ddp),
    "tp": Section(
        "Tensor parallelism on XLA (4 devices, a transformers LM with its own plan): ddp, fsdp, TP, 2-D",
        run_tp,
        tp_section,
        charted=True,
    ),
    "work": Section(
        "Every device's share of the work (4 devices, 3 AdamW steps per model and strategy)", run_work, render_work
    ),
    "memory": Section(
        "Each device's peak under fsdp against depth (4 XLA devices, XLA's buffer assignment)", run_memory,
        render_memory,
    ),
}


# --- RESULTS.md: one block per section, each replaced alone ----------------------------------------

BLOCK = re.compile(r"<!-- bench:([\w-]+) -->\n.*?<!-- /bench:\1 -->\n*", re.S)


def block(name, lines):
    return "\n".join([f"<!-- bench:{name} -->", *lines, f"<!-- /bench:{name} -->"])


def commit():
    """The commit the code ran at, '(dirty)' when tracked files differed from it."""
    def git(*args):
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + (
            " (dirty)" if git("status", "--porcelain", "--untracked-files=no") else ""
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def provenance(name, at, smoke, alone, elapsed, load):
    """The line under a section's heading: what ran it, and how to run it again."""
    return (f"commit {at} · `./dev.sh bench --only {name}{' --smoke' if smoke else ''}` · "
            f"{datetime.date.today().isoformat()}, {elapsed / 60:.1f} min, load {load[0]:.2f}→{load[1]:.2f} "
            "(1-minute average)"
            + ("" if alone else " · ran in a full `./dev.sh bench`"))


def write_sections(path, new, header_block):
    """Write the blocks `new` (name -> text) into the Markdown at `path`: each replaces the block of
    its name; the other blocks stay as they are, with their own commit lines; the text outside every
    block (the hand-written Findings) follows them. `header_block` goes where the file has no header."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    blocks = {"header": header_block, **{m.group(1): m.group(0).strip("\n") for m in BLOCK.finditer(old)}, **new}
    rest = BLOCK.sub("", old).strip("\n")
    order = ["header", *SECTIONS]
    names = [n for n in order if n in blocks] + [n for n in blocks if n not in order]
    with open(path, "w") as f:
        f.write("\n\n".join([blocks[n] for n in names] + ([rest] if rest else [])) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few steps of everything, for CI")
    p.add_argument(
        "--out", default=None, help="Markdown results (default: bench/RESULTS.md, none in --smoke or --only)"
    )
    p.add_argument("--png", default=None, help="chart (default: bench/step_times.png, none in --smoke or --only)")
    p.add_argument("--skip-ray", action="store_true", help="leave the ray section out")
    p.add_argument(
        "--only",
        nargs="+",
        choices=list(SECTIONS),
        metavar="NAME",
        help=f"run these sections alone, of: {', '.join(SECTIONS)}; with --out, replace just them in that file",
    )
    p.add_argument("--jobs", type=int, default=1, help="sections at once (--smoke only: they would time each other)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--workload", default="mlp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.workload)
    if args.child:
        return CHILDREN[args.child[0]](*args.child[1:])
    if args.jobs < 1 or (args.jobs > 1 and not args.smoke):
        p.error(f"--jobs {args.jobs}: give 1, or more with --smoke alone (sections that run at once load each other's "
                "timings); a smoke run times nothing")
    s = Settings(args.smoke)
    if s.smoke:  # it times nothing: XLA compiles ~3x faster with LLVM's optimisations off (tests/child.py), same values
        harness.WARM = True
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {child.FAST_COMPILES}".strip()
    quiet = s.smoke or args.only  # a smoke run or sections alone must not overwrite the full results
    out = args.out or (None if quiet else os.path.join(ROOT, "bench", "RESULTS.md"))
    png = args.png or (None if quiet else os.path.join(ROOT, "bench", "step_times.png"))
    names = [n for n in SECTIONS if n in (args.only or SECTIONS) and not (args.skip_ray and n == "ray")]
    at = commit()
    started, load_before = time.time(), os.getloadavg()[0]
    results, blocks, headline, took = {}, {}, [], {}

    def run(name):  # a section's work runs in child processes: threads are enough to run several at once
        section_started, section_load = time.time(), os.getloadavg()[0]
        return SECTIONS[name].run(s), time.time() - section_started, (section_load, os.getloadavg()[0])

    pool = concurrent.futures.ThreadPoolExecutor(args.jobs)
    futures = {name: pool.submit(run, name) for name in names}
    try:
        ran = {name: futures[name].result() for name in names}  # the first failure, in order, ends the run
    finally:
        pool.shutdown(cancel_futures=True)
    for name in names:
        section, (results[name], took[name], section_load) = SECTIONS[name], ran[name]
        line = provenance(name, at, s.smoke, bool(args.only), took[name], section_load)
        md, lines = section.render(results[name], s)
        blocks[name] = block(name, [f"## {section.heading}", "", line, "", *md])
        headline += lines
    elapsed, load = time.time() - started, (load_before, os.getloadavg()[0])
    headline.append(
        f"load average (1 min): {load[0]:.2f} at the start, {load[1]:.2f} at the end; wall time {elapsed / 60:.1f} min "
        f"({', '.join(f'{name} {t:.0f} s' for name, t in took.items())})"
    )
    print(
        "\n".join(
            [
                "seamless_tpu "
                f"benchmark{' --only ' + ' '.join(names) if args.only else ''}{' (smoke)' if s.smoke else ''}",
                *headline,
            ]
        )
    )
    if out:
        # the header describes a whole run: sections alone keep the one there, or write it where none is
        header_block = block("header", header("seamless_tpu benchmark results", s.smoke, elapsed, load))
        write_sections(out, blocks if args.only else {"header": header_block, **blocks}, header_block)
    rows = [r for n, result in results.items() if SECTIONS[n].charted for r in result["rows"]]
    if png and rows:
        chart(rows, png)


if __name__ == "__main__":
    main()
