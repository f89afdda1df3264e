"""The bench's shared harness: paths and settings every section uses, how the driver starts a child process and
reads what it report()s, the worker processes it times in interleaved rounds (Worker, compare: the A/A method
bench.py's docstring describes), and the pieces each section's write-up shares (fmt, pooled, RUN_TABLE, header,
chart). bench/bench.py is the entry point: children re-run it (--child NAME ARGS, --worker NAME)."""

import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # seamless_tpu; bench/ itself (hlo.py) is on the path as bench.py's folder
TESTS_PATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])  # PYTHONPATH of the tests/ scripts run as workloads
BENCH = os.path.join(ROOT, "bench", "bench.py")  # the entry point, which the children re-run: --child, --worker

sys.path.insert(1, os.path.join(ROOT, "tests"))
import child  # noqa: E402  (its XLA flag and warm starts, for the smoke run, which times nothing)
THREADS = 1
XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
EAGER_ENV = {"USE_TORCH_XLA": "0"}  # accelerate otherwise moves to XLA whenever torch_xla is installed
TP_VARIANTS = {  # variant -> trainer arguments (all through the shim, the same loop)
    "shim": {}, "shim_fsdp": {"strategy": "fsdp"},
    "shim_tp": {"xla_spmd_config": {"model_parallel_size": 4}},
    "shim_2d": {"strategy": "fsdp", "xla_spmd_config": {"model_parallel_size": 2}},
}
DUMP_HLO = "SEAMLESS_TPU_BENCH_DUMP_HLO"  # set: the worker has XLA dump the HLO it compiles (compile time only)
AA = " (A/A)"  # label suffix of the baseline's second, independent worker


# --- child processes: a fresh interpreter per measurement ----------------------------------------


def report(obj):
    """What a child tells the driver: one line `RESULT <json>` on stdout (tests/ scripts print the same)."""
    print("RESULT " + json.dumps(obj), flush=True)


def result(stdout, what):
    """The one object a child report()ed in `stdout`."""
    found = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    if len(found) != 1:
        raise RuntimeError(f"{what} printed {len(found)} RESULT lines, not 1:\n{stdout[-3000:]}")
    return json.loads(found[0])


WARM = False  # True in a smoke run: its XLA children start warm (tests/zygote.py), ~10 s of CPU less each


def python(args, env):
    """The command line of `python ARGS` in `env`: a fresh interpreter, or in a smoke run a warm XLA child."""
    return child.command(args, env) if WARM else [sys.executable, *map(str, args)]


def run_script(args, env, timeout=600):
    """What `python ARGS`, run from the repository root, report()ed; a failure raises with its stderr."""
    what = " ".join(map(str, args))
    out = subprocess.run(python(args, env), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{what} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return result(out.stdout, what)


def run_child(name, *args, env, timeout=600):
    """What CHILDREN[name](*args) report()ed, run in a fresh interpreter: bench/bench.py --child NAME ARGS."""
    return run_script([BENCH, "--child", name, *args], env, timeout)


# --- driver side ---------------------------------------------------------------------------------


class Worker:
    def __init__(self, name, workload, env=None, label=None):
        self.name = label or name
        env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
        env.pop("SEAMLESS_TPU_DEVICE", None)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(python([BENCH, "--worker", name, "--workload", workload], env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

    def send(self, cmd):
        self.cmd = cmd
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def receive(self):
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            code = self.proc.wait(timeout=60)  # a negative code is the signal that ended it (-11: a segfault)
            raise RuntimeError(f"benchmark worker {self.name!r} died on {self.cmd!r} (exit {code}):\n"
                               f"{self.log.read()[-3000:]}")
        return json.loads(line)

    def ask(self, cmd):
        self.send(cmd)
        return self.receive()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.log.close()


def interleaved(workers, warm, rounds, steps, rng):
    """Warm every variant, then run `rounds` rounds of one block of `steps` steps per variant, in
    a fresh random order each round: a fixed order would give one variant the same neighbour (and
    the same place in a load burst) every time."""
    for w in workers:  # all at once: start-up and compiles are not timed, and they are most of a smoke run
        w.send(f"run {warm}")
    for w in workers:
        w.receive()
    times = {w.name: [] for w in workers}
    deltas = {w.name: [] for w in workers}
    for _ in range(rounds):
        for w in rng.sample(workers, len(workers)):
            reply = w.ask(f"run {steps}")
            times[w.name].append(reply["step_s"])
            deltas[w.name].append(reply["delta"])
    return times, deltas


def summary(samples):
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return {"median": statistics.median(samples), "iqr": q[2] - q[0]}


def interval(ratios, resamples=2000, seed=0):
    """Median ratio over rounds and its 95% percentile-bootstrap interval. Whole rounds are
    resampled, because the blocks of one round shared the machine's load at that moment."""
    rng = random.Random(seed)  # fixed: the same data must print the same interval
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def verdict(low, high, target):
    """A target is judged only where the whole interval lies on one side of it."""
    if target is None:
        return ""
    if high < target:
        return "met"
    if low > target:
        return "missed"
    return "not resolved at this noise"


def compare(title, workload, names, baseline, env, warm, rounds, steps, repeats, rng, after=()):
    """Rows of one comparison, `repeats` times in fresh workers. `after`: commands that, once the
    last run's rounds are over, each worker of `names` answers in turn (one worker busy at a time,
    so they may be timed); the replies go into that run's rows as row["after"][command]."""
    rows = []
    for repeat in range(repeats):
        load_before = os.getloadavg()[0]
        workers = [Worker(baseline, workload, env), Worker(baseline, workload, env, label=baseline + AA)]
        workers += [Worker(n, workload, env) for n in names if n != baseline]
        replies = {}
        try:
            times, deltas = interleaved(workers, warm, rounds, steps, rng)
            for cmd in (after if repeat == repeats - 1 else ()):
                for w in workers:
                    if w.name in names:
                        replies.setdefault(w.name, {})[cmd] = w.ask(cmd)
        finally:
            for w in workers:
                w.close()
        load = (load_before, os.getloadavg()[0])
        for w in workers:
            n = w.name
            s = summary(times[n])
            ratios = [t / b for t, b in zip(times[n], times[baseline])]
            transfers = [d.get("transfers") for d in deltas[n] if "transfers" in d]
            compiles = [d.get("compiles") for d in deltas[n] if "compiles" in d]
            rows.append(
                {
                    "comparison": title,
                    "workload": workload,
                    "run": repeat + 1,
                    "variant": n,
                    "baseline": n == baseline,
                    "median_ms": s["median"] * 1e3,
                    "iqr_ms": s["iqr"] * 1e3,
                    "round_ratios": ratios,
                    "ratio": interval(ratios),
                    "load": load,
                    "samples_ms": [t * 1e3 for t in times[n]],
                    "transfers_per_step": (sum(transfers) / (len(transfers) * steps)) if transfers else None,
                    "compiles_in_steady_state": sum(compiles) if compiles else None,
                    "after": replies.get(n, {}),
                }
            )
    return rows


def ask_once(name, env, cmd):
    """A fresh worker's reply to one command (the MLP workload)."""
    w = Worker(name, "mlp", env)
    try:
        return w.ask(cmd)
    finally:
        w.close()


# --- sections: how long they run, what one is, and the pieces their write-ups share -----------------


class Settings:
    """How long the comparisons run: a few steps of each in a smoke run, the full plan otherwise."""

    def __init__(self, smoke):
        self.smoke = smoke
        self.warm, self.repeats = (3, 1) if smoke else (10, 2)
        # (rounds, steps per block): short blocks, so a burst of load spans whole rounds; the MLP, whose
        # steps are the cheapest and the noisiest, gets the most rounds
        self.plan = {"mlp": (3, 2), "transformer": (3, 2)} if smoke else {"mlp": (150, 10), "transformer": (20, 4)}

    def block(self, workload, xla):
        """(rounds, steps per block) of a workload; an XLA transformer block has half the steps."""
        rounds, steps = self.plan[workload]
        return rounds, (max(1, steps // 2) if xla and workload == "transformer" else steps)


@dataclasses.dataclass(frozen=True)
class Section:
    """One comparison. run(settings) -> result; render(result, settings) -> (Markdown lines under the
    heading, headline lines). charted: result["rows"] are step-time rows for the chart."""

    heading: str
    run: object
    render: object
    charted: bool = False


def versions():
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "torch_xla", "ray", "accelerate", "lightning"):
        try:
            out[name] = version(name)  # metadata only: importing torch_xla here would start nothing good
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []
    for r in rows:
        key = (r["comparison"], r["workload"])
        if key not in groups:
            groups.append(key)
    fig, axes = plt.subplots(1, len(groups), figsize=(max(10, 5 * len(groups)), 4.5), squeeze=False)  # title: 10 in
    for ax, key in zip(axes[0], groups):
        sel = [r for r in rows if (r["comparison"], r["workload"]) == key]
        labels = [f"{r['variant']}\nrun {r['run']}" for r in sel]
        boxes = ax.boxplot([r["samples_ms"] for r in sel], showfliers=True, patch_artist=True)
        for box, r in zip(boxes["boxes"], sel):  # the baseline and its A/A twin in grey: their gap is the noise floor
            box.set_facecolor("lightgrey" if r["baseline"] or r["variant"].endswith(AA) else "lightsteelblue")
        ax.set_xticks(range(1, len(sel) + 1), labels, fontsize=7, rotation=45, ha="right")
        ax.set_title(f"{key[0]}: {key[1]}", fontsize=9)
        ax.set_ylabel("ms per step (one point per block)")
    fig.suptitle(
        "seamless_tpu step time per variant (random-order rounds, 2-core shared machine; grey: baseline and its A/A "
        "twin)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt(stats):
    return f"{stats[0]:.3f} [{stats[1]:.3f}, {stats[2]:.3f}]"


def pooled(rows, comparison, workload, variant):
    """Both runs' rounds together: each round's ratio is still paired within its own run."""
    return interval(
        [
            x
            for r in rows
            if (r["comparison"], r["workload"], r["variant"]) == (comparison, workload, variant)
            for x in r["round_ratios"]
        ]
    )


def header(title, smoke, elapsed, load):
    v = versions()
    return [f"# {title}{' (smoke run)' if smoke else ''}", "",
            f"- date: {datetime.date.today().isoformat()}; wall time {elapsed / 60:.1f} min",
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; torch threads pinned "
            f"to {THREADS}",
            f"- load (1-minute average, os.getloadavg): {load[0]:.2f} at the start, {load[1]:.2f} at the end; per "
            "section in its "
            "commit line, per comparison run in its table",
            "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
            "- method: each variant in its own process, plus a second, independent baseline process (A/A: the noise "
            "floor); "
            "after warm-up, rounds of one short block per variant in random order; ratio = median over rounds of "
            "(variant block / baseline block, same round), [95% bootstrap interval over rounds]; every comparison "
            "run twice (run 1, run 2)",
            "- verdict: met when the interval's upper end is under the target, missed when its lower end is over it, "
            "otherwise not resolved at this noise",
            "- sections: each names the commit it ran at and the command that runs it alone; "
            "`./dev.sh bench --only NAME --out bench/RESULTS.md` replaces that section and keeps the others"]


RUN_TABLE = [
    "| comparison | workload | run | variant | median ms/step | IQR ms | ratio [95% interval] | load before→after | "
    "device->host transfers/step | compiles in steady state |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def run_rows(rows):
    """One line per (comparison, run, variant) of the per-run table."""
    md, seen = [], set()
    for r in rows:
        run = (r["comparison"], r["workload"], r["run"])
        load_cell = "" if run in seen else f"{r['load'][0]:.2f}→{r['load'][1]:.2f}"
        seen.add(run)
        ratio = "1 (baseline)" if r["baseline"] else fmt(r["ratio"])
        t = "" if r["transfers_per_step"] is None else f"{r['transfers_per_step']:.2f}"
        c = "" if r["compiles_in_steady_state"] is None else str(r["compiles_in_steady_state"])
        md.append(
            f"| {r['comparison']} | {r['workload']} | {r['run']} | {r['variant']} | {r['median_ms']:.3f} | "
            f"{r['iqr_ms']:.3f} | {ratio} | {load_cell} | {t} | {c} |"
        )
    return md


def by_depth(runs):
    """The 'workload/depth' keys of `runs`, keyed 'workload/depth/loop', by workload, then depth as a number."""
    return sorted({k.rsplit("/", 1)[0] for k in runs}, key=lambda k: (k.split("/")[0], int(k.split("/")[1])))


def mb(n):
    return f"{n / 1e6:.2f} MB" if n >= 10_000 else f"{n:,} B"
