"""What seamless_tpu costs, measured side by side in one run, with how much the run can resolve.

    ./dev.sh bench                      # every section: writes bench/RESULTS.md and bench/step_times.png
    ./dev.sh bench --smoke [--jobs 2]   # a few steps of every section (CI: 2 sections at once); writes nothing
                                        # unless --out is given
    ./dev.sh bench --only NAME [NAME..] [--out F]   # those sections alone (SECTIONS below: xla_spmd,
                                        # logging, eager_cpu, compiles, overhead, imports, ray, fsdp, compile,
                                        # accumulate, checkpoints, preemption, ddp, tp, work); writes nothing
                                        # unless --out is given

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
"""

import argparse
import concurrent.futures
import dataclasses
import datetime
import glob
import importlib
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # seamless_tpu; bench/ itself (hlo.py) is on the path as this script's folder
TESTS_PATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])  # PYTHONPATH of the tests/ scripts run as workloads

import hlo  # noqa: E402  (bench/hlo.py: what XLA compiled; the tests read dot FLOPs with it too)

sys.path.insert(1, os.path.join(ROOT, "tests"))
import child  # noqa: E402  (its XLA flag and warm starts, for the smoke run, which times nothing)
THREADS = 1
XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
EAGER_ENV = {"USE_TORCH_XLA": "0"}  # accelerate otherwise moves to XLA whenever torch_xla is installed
TARGETS = {("xla_spmd_4dev", "shim"): 1.02, ("eager_cpu", "shim"): 1.01, ("xla_logging", "shim_log"): 1.02}  # at most
LOG_VARIANTS = ("shim_log", "shim_item")  # the shim's loop plus trainer.log(loss=loss) / loss.item() every step
BASE_NAMES = {"handwritten_xla": "hand-written torch_xla", "plain": "plain PyTorch", "shim": "seamless_tpu ddp"}
FSDP = "xla_fsdp_vs_ddp"  # the comparison's title: strategy='fsdp' against 'ddp', both through the shim
FSDP_MEMORY_TARGET = 0.30  # per-device parameter + optimizer-state bytes, fsdp / ddp, at most
TP = "xla_tensor_parallel"  # the comparison's title: ddp, fsdp, tensor parallel and 2-D on a transformers LM
TP_VARIANTS = {  # variant -> trainer arguments (all through the shim, the same loop)
    "shim": {}, "shim_fsdp": {"strategy": "fsdp"},
    "shim_tp": {"xla_spmd_config": {"model_parallel_size": 4}},
    "shim_2d": {"strategy": "fsdp", "xla_spmd_config": {"model_parallel_size": 2}},
}
TP_NAMES = {"shim": "ddp (4,) data", "shim_fsdp": "fsdp (4,) fsdp", "shim_tp": "tensor parallel (1, 4) data x model",
            "shim_2d": "2-D (2, 2) fsdp x model"}
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
    return run_script([os.path.abspath(__file__), "--child", name, *args], env, timeout)


# --- worker side: one variant, one workload ------------------------------------------------------


def build(workload):
    import torch

    torch.manual_seed(0)
    if workload == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

        def loss_fn(m, x, y):
            return torch.nn.functional.cross_entropy(m(x), y)
    elif workload == "lm":  # a transformers Qwen3 from a config (random weights, nothing downloaded), its TP plan
        import transformers

        config = transformers.Qwen3Config(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            max_position_embeddings=256,
            attn_implementation="eager",
            use_cache=False,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
        x = torch.randint(0, 2048, (8, 128))
        y = x.clone()

        def loss_fn(m, x, y):
            return m(input_ids=x, labels=y).loss
    else:
        layer = torch.nn.TransformerEncoderLayer(
            d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0, batch_first=True
        )
        model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        x, y = torch.randn(16, 128, 256), torch.randn(16, 128, 256)

        def loss_fn(m, x, y):
            return torch.nn.functional.mse_loss(m(x), y)
    return model, x, y, loss_fn


def handwritten_xla(model):
    """The torch_xla SPMD set-up people write by hand. Returns put(tensor): on the device, dim 0
    sharded over a 1-D 'data' mesh."""
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    torch.__future__.set_swap_module_params_on_conversion(True)  # keep the optimizer's params
    model.to(device)

    def put(t):
        t = t.to(device)
        xs.mark_sharding(t, mesh, ("data",) + (None,) * (t.dim() - 1))
        return t

    return put


class Variant:
    """Sets up one way of writing the loop; step() runs one optimizer step; wait() drains the device."""

    def __init__(self, name, workload):
        import torch

        torch.set_num_threads(THREADS)
        self.name, self.torch = name, torch
        model, x, y, self.loss_fn = build(workload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.wait, self.metrics = (lambda: None), None
        if name == "plain":
            pass
        elif name in TP_VARIANTS or name in LOG_VARIANTS:
            import seamless_tpu as st

            trainer = st.SeamlessTPUTrainer(model, **TP_VARIANTS.get(name, {}), progress=False)
            x, y = trainer.to_device(x, y)
            self.trainer = trainer
            if st.is_xla_backend():
                self._xla_waits()
        elif name == "handwritten_xla":
            import torch_xla

            put = handwritten_xla(model)
            x, y = put(x), put(y)
            self.sync = torch_xla.sync
            self._xla_waits()
        elif name == "accelerate":
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=True)
            model, optimizer = self.accelerator.prepare(model, optimizer)
        elif name == "fabric":
            from lightning.fabric import Fabric

            self.fabric = Fabric(accelerator="cpu", devices=1)
            model, optimizer = self.fabric.setup(model, optimizer)
        self.model, self.optimizer, self.x, self.y = model, optimizer, x, y

    def _xla_waits(self):
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        self.wait, self.metrics = xm.wait_device_ops, met

    def step(self):
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model, self.x, self.y)
        if self.name == "accelerate":
            self.accelerator.backward(loss)
        elif self.name == "fabric":
            self.fabric.backward(loss)
        else:
            loss.backward()
        self.optimizer.step()
        if self.name == "handwritten_xla":
            self.sync()
        elif self.name == "shim_log":
            self.trainer.log(1, loss=loss)  # read on the log's thread once the step ran
        elif self.name == "shim_item":
            loss.item()  # what trainer.log replaces: the host waits for the step, every step

    def counters(self):
        if self.metrics is None:
            return {}
        transfers = self.metrics.metric_data("TransferFromDeviceTime")
        return {
            "compiles": self.metrics.counter_value("UncachedCompile") or 0,
            "transfers": transfers[0] if transfers else 0,
        }


def compiles_over_epochs(name, samples=70, batch=8, epochs=3):
    """Comparison 3: UncachedCompile per step over 3 epochs of a dataset that batches unevenly."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    if name == "shim":
        import seamless_tpu as st

        prepared = st.SeamlessTPUTrainer(model).prepare_data_loader(loader)

        def epoch():
            return prepared
    else:  # the loop most people write first: no drop_last
        put = handwritten_xla(model)

        def epoch():
            return ((put(x), put(y)) for x, y in loader)
    counts = []
    for _ in range(epochs):
        for x, y in epoch():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if name != "shim":
                torch_xla.sync()
            counts.append(met.counter_value("UncachedCompile") or 0)
    return counts


def shim_overhead(variant, reps=20000):
    """The shim's own Python work per optimizer step, timed in isolation: the real global hooks it runs around
    every step, called back to back. On XLA the graph cut's two, with torch_xla.sync stubbed out (no device
    work); everywhere the preemption hook (one process: a flag read) and the optimizer-rebinding one that FSDP2
    and tensor parallelism install (a parameter count)."""
    from torch.optim import optimizer as optim_module

    import seamless_tpu as st

    hooks = len(optim_module._global_optimizer_pre_hooks) + len(optim_module._global_optimizer_post_hooks)
    opt = variant.optimizer
    calls = [lambda: st._STATE.preemption._after_step(opt, (), {}), lambda: st._rebind_before_step(opt, (), {})]
    sync = None
    if st.is_xla_backend():
        import torch_xla

        sync, torch_xla.sync = torch_xla.sync, lambda *args, **kwargs: None
        calls += [lambda: st._before_xla_step(opt, (), {}), lambda: st._after_xla_step(opt, (), {})]
    try:
        start = time.perf_counter()
        for _ in range(reps):
            for call in calls:
                call()
        seconds = time.perf_counter() - start
    finally:
        if sync is not None:
            torch_xla.sync = sync
    return {"global_optimizer_hooks": hooks, "us_per_step": seconds / reps * 1e6}


def profile(variant, dump):
    """Per-device bytes and the step's collectives. Asked after the timed rounds: the optimizer
    state exists, and the last graph compiled is the steady-state step."""
    variant.step()  # a fresh variant gets its optimizer state; a warm one compiles nothing
    shapes = [tuple(p.shape) for p in variant.model.parameters()]
    dots = None
    if dump and glob.glob(os.path.join(dump, "*spmd-partitioning*")):
        dots = hlo.dot_flops_per_device(dump)
    return {
        "bytes": variant.trainer.memory_stats(variant.optimizer),
        "collectives": hlo.step_collectives(dump, shapes) if dump else {},
        "dot_flops": dots,
    }


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


# --- driver side ---------------------------------------------------------------------------------


class Worker:
    def __init__(self, name, workload, env=None, label=None):
        self.name = label or name
        env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
        env.pop("SEAMLESS_TPU_DEVICE", None)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(python([__file__, "--worker", name, "--workload", workload], env),
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


def import_cost(repeats):
    """Comparison 5: milliseconds to import each module in a fresh interpreter after torch."""
    modules = ("seamless_tpu", "accelerate", "lightning.fabric")
    results = {k: [] for k in modules}
    env = dict(os.environ, PYTHONPATH=ROOT, **EAGER_ENV)
    for _ in range(repeats):
        for module in modules:
            results[module].append(run_child("import", module, env=env) * 1e3)
    return results


def import_child(module):
    """Seconds to import `module` in this fresh interpreter, after torch (and the bench's own stdlib imports,
    alike for every module)."""
    import torch  # noqa: F401

    start = time.perf_counter()
    importlib.import_module(module)
    report(time.perf_counter() - start)


def ray_fit_times(rounds, rng, twin=True):
    """Comparison 6: wall time of a 2-worker CPU fit, seamless_tpu.TorchConfig vs Ray's stock gloo.
    Stock gloo runs as two independent variants (A/A); each round runs the three fits in random order.
    twin=False (a smoke run, whose one round judges nothing) leaves the A/A twin out: 40 s less."""
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_AUTH_MODE="disabled", RAY_TRAIN_ENABLE_PRINT_PATCH="0")
    results = {"seamless": [], "ray_gloo": [], **({"ray_gloo" + AA: []} if twin else {})}
    for _ in range(rounds):
        for kind in rng.sample(list(results), len(results)):
            results[kind].append(run_child("ray-fit", kind.split()[0], env=env))
    return results


def ray_fit_loop(config):
    """The training function both fits run on each Ray worker: 50 steps of a linear model."""
    import torch

    import seamless_tpu as st

    first = time.time()
    model = torch.nn.Linear(64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = st.SeamlessTPUTrainer(model)
    x, y = trainer.to_device(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    for _ in range(50):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with open(config["out"], "a") as f:
        f.write(json.dumps({"train_start": first, "train_end": time.time()}) + "\n")


def ray_fit_child(kind):
    """One 2-worker CPU fit on a fresh local cluster, through seamless_tpu's TorchConfig ("seamless") or
    Ray's stock gloo backend ("ray_gloo"): reports its fit, time to the first step, and training seconds."""
    import ray
    from ray.train import RunConfig, ScalingConfig

    import seamless_tpu as st

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    out = tempfile.mktemp()
    if kind == "seamless":
        trainer_class, config = st.TorchTrainer, st.TorchConfig()
    else:
        from ray.train.torch import TorchConfig, TorchTrainer

        trainer_class, config = TorchTrainer, TorchConfig(backend="gloo")
    trainer = trainer_class(ray_fit_loop, train_loop_config={"out": out}, torch_config=config,
                            scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(storage_path=tempfile.mkdtemp()))
    fit_start = time.time()
    trainer.fit()
    end = time.time()
    with open(out) as f:
        spans = [json.loads(line) for line in f]
    report({"fit_s": end - fit_start, "to_first_step_s": min(s["train_start"] for s in spans) - fit_start,
            "train_s": max(s["train_end"] for s in spans) - min(s["train_start"] for s in spans)})
    ray.shutdown()


def fsdp_vs_ddp(warm, rounds, steps, repeats, checkpoint_reps, rng):
    """Issue 9: strategy='fsdp' against 'ddp', both through the shim, on XLA with 4 devices and the
    transformer. Step time in rounds (ddp is the baseline, with its A/A twin). Then the last run's
    ddp and fsdp workers, which dump the HLO they compile, count their per-device bytes and their
    step's collectives, and time checkpoints. Reusing them saves two start-ups and their compiles,
    most of a smoke run."""
    checkpoint = f"checkpoint {checkpoint_reps}"
    rows = compare(FSDP, "transformer", ["shim", "shim_fsdp"], "shim", dict(XLA_ENV, **{DUMP_HLO: "1"}),
                   warm, rounds, steps, repeats, rng, after=("profile", checkpoint))
    profiles = {
        r["variant"]: {**r["after"]["profile"], "checkpoint": r["after"][checkpoint]} for r in rows if r["after"]
    }
    return {"rows": rows, "profiles": profiles}


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


def mb(n):
    return f"{n / 1e6:.2f} MB" if n >= 10_000 else f"{n:,} B"


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


# --- sections: each comparison, runnable alone (--only NAME), and how it is written up ---------------


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


def ask_once(name, env, cmd):
    """A fresh worker's reply to one command (the MLP workload)."""
    w = Worker(name, "mlp", env)
    try:
        return w.ask(cmd)
    finally:
        w.close()


def run_compiles(s):
    return {name: ask_once(name, XLA_ENV, "compiles")["counts"] for name in ("shim", "handwritten_xla")}


def render_compiles(compiles, s):
    md, headline = [], []
    for name, counts in compiles.items():
        warm = counts[min(1, len(counts) - 1)]
        md.append(
            f"- {name}: {len(counts)} steps, UncachedCompile after step 2 = {warm}, at the end = {counts[-1]} "
            f"(growth after warm-up: {counts[-1] - warm})"
        )
        headline.append(f"compiles after warm-up over 3 epochs: {name} +{counts[-1] - warm}")
    return md, headline


def run_overhead(s):
    return {label: ask_once("shim", env, "overhead") for label, env in (("xla", XLA_ENV), ("eager_cpu", EAGER_ENV))}


def render_overhead(overhead, s):
    md = ["The real hooks the shim runs around every optimizer step, called back to back: everywhere the preemption "
          "hook (one process: a flag read) and the rebinding hook of FSDP2 and tensor parallelism (a parameter count); "
          "on XLA also `_before_xla_step` and `_after_xla_step`, with `torch_xla.sync` replaced by a no-op, so no "
          "device work is timed.", ""]
    md += [
        f"- {label}: {o['us_per_step']:.2f} us per optimizer step; global optimizer hooks installed: "
        f"{o['global_optimizer_hooks']}"
        for label, o in overhead.items()
    ]
    return md, [
        "shim's own work per step: "
        + ", ".join(
            f"{k} {o['us_per_step']:.2f} us ({o['global_optimizer_hooks']} global hooks)" for k, o in overhead.items()
        )
    ]


def render_imports(imports, s):
    md = ["| module | median | min | max |", "|---|---|---|---|"]
    md += [f"| {name} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} |" for name, v in imports.items()]
    return md, [
        "import after torch (median ms): " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in imports.items())
    ]


def render_ray(ray_times, s):
    md = ["| backend config | round | fit | to first step | training |", "|---|---|---|---|---|"]
    for kind, runs in ray_times.items():
        for i, r in enumerate(runs):
            md.append(f"| {kind} | {i + 1} | {r['fit_s']:.1f} | {r['to_first_step_s']:.1f} | {r['train_s']:.2f} |")
    fit = {k: [r["fit_s"] for r in runs] for k, runs in ray_times.items()}
    stats = interval([a / b for a, b in zip(fit["seamless"], fit["ray_gloo"])])
    floor = (
        fmt(interval([a / b for a, b in zip(fit["ray_gloo" + AA], fit["ray_gloo"])]))
        if "ray_gloo" + AA in fit
        else "not run (smoke)"
    )
    line = (
        f"ray 2-worker fit: seamless / stock gloo = {fmt(stats)} ({len(fit['seamless'])} "
        f"round{'s' if len(fit['seamless']) != 1 else ''}; median "
        f"{statistics.median(fit['seamless']):.1f} s vs {statistics.median(fit['ray_gloo']):.1f} s); "
        f"A/A floor {floor}; report only (no target)"
    )
    return md + ["", f"- {line}"], [line]


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


# bench/compile_depth.py's loops per workload. Not hand_scan: torch_xla 2.9's scan backward under SPMD imports jax
# (shard_as), which torch_xla[pallas] brings and this environment has not: ModuleNotFoundError; the trainer runs it
COMPILE_MODES = {"gpt": ("hand", "shim", "shim_scan"), "kd": ("seed", "hand", "shim")}
COMPILE_DEPTHS = {"gpt": (2, 8, 24), "kd": (4, 8)}


def run_compile(s):
    """bench/compile_depth.py: an SDPA GPT at 2, 8 and 24 blocks, and the seeds' workload (a Qwen3 + LoRA student,
    a frozen teacher, KL divergence) at 4 and 8 layers (2 and 1 in a smoke run), each loop in a fresh process, the
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
    for key in sorted({k.rsplit("/", 1)[0] for k in runs}, key=lambda k: (k.split("/")[0], int(k.split("/")[1]))):
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
                headline.append(line)
    return md + [""] + [f"- {line}" for line in headline], headline


def gpu_saves_child(rounds, steps=10):
    """CUDA only: 8 Linear(4096, 4096) layers with AdamW (1.6 GB of state), batch 64. The step time through the
    trainer against the same model in a plain loop (blocks in a random order each round, plain twice for the A/A
    floor); the pinned-copy time of the state (its floor); save_checkpoint(blocking=False)'s return time per save;
    and the step time while that save is in flight (the block right after the call) against the trainer's quiet
    block of the same round, as shipped and with the GPU's room for a copy of the state hidden (the steps then wait
    for the host copies). Reports {"times", "pinned_copy_s", "returns_s", "quiet", "during", "waiting",
    "in_flight"}."""
    import shutil

    import torch

    import seamless_tpu as st

    rounds, steps = int(rounds), int(steps)

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)])

    model = build()
    trainer = st.SeamlessTPUTrainer(model, device="gpu")
    plain = build().to(trainer.device)
    optimizers = {"trainer": torch.optim.AdamW(model.parameters(), lr=1e-5),
                  "plain": torch.optim.AdamW(plain.parameters(), lr=1e-5)}
    optimizers["plain" + AA] = optimizers["plain"]
    models = {"trainer": model, "plain": plain, "plain" + AA: plain}
    x = torch.randn(64, 4096, device=trainer.device)

    def block(name):  # the training stream's time: a device-wide synchronize would wait for the save's copies too
        m, opt, stream = models[name], optimizers[name], torch.cuda.current_stream()
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        stream.synchronize()
        return (time.perf_counter() - start) / steps

    for name in models:
        block(name)
    state = [t for t in [*model.state_dict().values(), *(v for s in optimizers["trainer"].state.values()
                                                          for v in s.values())] if t.is_cuda]
    pinned, copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state], []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for b, t in zip(pinned, state):
            b.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
    del pinned
    times, returns, quiet, during, in_flight = {name: [] for name in models}, [], [], {}, 0
    no_room = {"mem_get_info": lambda device=None: (0, 1), "memory_reserved": lambda device=None: 0}
    for r in range(rounds):
        for name in random.Random(r).sample(sorted(times), len(times)):
            times[name].append(block(name))
        quiet.append(times["trainer"][-1])
        for room in random.Random(r).sample([True, False], 2):  # without room the steps wait for the host copies
            real, directory = {k: getattr(torch.cuda, k) for k in no_room}, tempfile.mkdtemp()
            vars(torch.cuda).update({} if room else no_room)
            try:
                start = time.perf_counter()
                future = trainer.save_checkpoint(directory, blocking=False, model=model,
                                                 optimizer=optimizers["trainer"])
            finally:
                vars(torch.cuda).update(real)
            if room:
                returns.append(time.perf_counter() - start)
            during.setdefault(room, []).append(block("trainer"))
            in_flight += room and not future.done()
            future.result()
            shutil.rmtree(directory)
    report({"times": times, "pinned_copy_s": min(copies), "state_bytes": sum(t.nbytes for t in state),
            "returns_s": returns, "quiet": quiet, "during": during[True], "waiting": during[False],
            "in_flight": in_flight, "device": torch.cuda.get_device_name()})


def save_while_training_child(rounds, steps=8):
    """Step time of an 85 MB MLP (AdamW: a 255 MB checkpoint) under fsdp on XLA, in blocks of `steps`: plain,
    plain again (A/A), and with an asynchronous save in flight, in a new order each round; and a blocking
    save's seconds. Reports {"times": {variant: [s per step]}, "blocking_save_s", "in_flight_blocks"}."""
    import torch
    import torch_xla.core.xla_model as xm

    import seamless_tpu as st

    rounds = int(rounds)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1152, 1152) for _ in range(16)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trainer = st.SeamlessTPUTrainer(model, strategy="fsdp")
    x = trainer.to_device(torch.randn(64, 1152))

    def step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    def block(save):
        future = save and trainer.save_checkpoint(tempfile.mkdtemp(), blocking=False, model=model, optimizer=optimizer)
        start = time.perf_counter()
        for _ in range(steps):
            step()
            xm.wait_device_ops()
        elapsed = time.perf_counter() - start
        in_flight = bool(future) and not future.done()
        if future:
            future.result()
        return elapsed, in_flight

    for _ in range(3):
        step()
    blocking = []
    for _ in range(rounds):
        start = time.perf_counter()
        trainer.save_checkpoint(tempfile.mkdtemp(), model=model, optimizer=optimizer)
        blocking.append(time.perf_counter() - start)
    times, still = {"plain": [], "plain (A/A)": [], "save in flight": []}, 0
    for r in range(rounds):
        for name in random.Random(r).sample(sorted(times), len(times)):
            elapsed, in_flight = block(name == "save in flight")
            times[name].append(elapsed / steps)
            still += in_flight
    report({"times": times, "blocking_save_s": statistics.median(blocking), "in_flight_blocks": still})


def preempt_time():
    """[seconds from SIGTERM to exit, whether the checkpoint was committed, exit code] of tests/preempt.py's
    preemptible loop on the CPU: the signal lands once it is training; it saves and exits 0."""
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.Popen(
            [sys.executable, "tests/preempt.py", "preemptible", d],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=TESTS_PATH, SEAMLESS_TPU_DEVICE="cpu"),
        )
        while not os.path.exists(os.path.join(d, "ready-0")) and p.poll() is None:
            time.sleep(0.01)
        start = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        seconds, committed = time.perf_counter() - start, os.path.exists(os.path.join(d, "ckpt", "LATEST"))
    if p.returncode:
        raise RuntimeError(f"tests/preempt.py exited {p.returncode} after SIGTERM:\n{err.decode()[-3000:]}")
    return [seconds, int(committed), p.returncode]


def run_checkpoints(s):
    """Load cost (tests/load_cost.py: a 255 MB fsdp checkpoint on 4 XLA devices), step time with an
    asynchronous save in flight against plain blocks and the A/A floor, and SIGTERM to exit with a
    committed checkpoint (tests/preempt.py on the CPU)."""
    out = {"preempt": [preempt_time() for _ in range(1 if s.smoke else 3)]}
    if importlib.util.find_spec("torch_xla"):  # a CUDA host may have none: its GPU rows below still run
        env = dict(os.environ, **XLA_ENV, SEAMLESS_TPU_DEVICE="xla", PYTHONPATH=TESTS_PATH)
        with tempfile.TemporaryDirectory() as d:
            out["load"] = {phase: run_script(["tests/load_cost.py", "fsdp4", phase, os.path.join(d, "c")], env)
                           for phase in ("save", "warm", "fresh")}
        out["saving"] = run_child("save-while-training", 2 if s.smoke else 7, env=env, timeout=900)
    if __import__("torch").cuda.is_available():  # the GPU path, where there is one
        gpu_env = dict(os.environ, SEAMLESS_TPU_DEVICE="gpu", PYTHONPATH=TESTS_PATH)
        out["gpu"] = run_child("gpu-saves", 2 if s.smoke else 5, env=gpu_env, timeout=600)
    return out


def render_checkpoints(result, s):
    seconds = statistics.median(p[0] for p in result["preempt"])
    line = f"checkpoints: SIGTERM to exit with a committed checkpoint {seconds:.2f} s"
    md = ["- The XLA rows need torch_xla, which this host does not have."]
    if "load" in result:
        md = ["| load (255 MB fsdp checkpoint, 4 XLA devices) | bytes read / checkpoint | peak growth / checkpoint "
              "| written |", "|---|---|---|---|"]
        for phase, what in (("warm", "into a trained trainer"),
                            ("fresh", "into a new model and optimizer (beyond the state it makes)")):
            r = result["load"][phase]
            grown = r["rss_peak"] - (r["rss_before"] if phase == "warm" else max(r["rss_before"], r["rss_after"]))
            md.append(f"| {what} | {r['read'] / r['checkpoint']:.3f} | {grown / r['checkpoint']:.3f} | "
                      f"{r['written']} B |")
        saving = result["saving"]
        times = saving["times"]
        base = statistics.median(times["plain"])
        ratio, floor = statistics.median(times["save in flight"]) / base, statistics.median(times[f"plain{AA}"]) / base
        md += ["", "| step time (85 MB MLP, AdamW, fsdp, 8-step blocks) | median s/step | ratio to plain |",
               "|---|---|---|", *(f"| {name} | {statistics.median(ts):.4f} | {statistics.median(ts) / base:.3f} |"
                                  for name, ts in times.items()), ""]
        line = (f"checkpoints: load reads {result['load']['warm']['read'] / result['load']['warm']['checkpoint']:.2f}x "
                f"the checkpoint; step time with an async save in flight {ratio:.2f}x plain (A/A {floor:.2f}x; a "
                f"blocking save takes {saving['blocking_save_s']:.2f} s; {saving['in_flight_blocks']} blocks ended "
                f"with the save still writing); SIGTERM to exit with a committed checkpoint {seconds:.2f} s")
    md += ["- SIGTERM to exit 0 with the checkpoint committed (tests/preempt.py, CPU, includes the next step and the "
           f"save): {', '.join(f'{p[0]:.2f} s' for p in result['preempt'])}; committed: "
           f"{all(p[1] for p in result['preempt'])}", f"- {line}"]
    lines = [line]
    if "gpu" in result:  # CUDA hosts only
        g = result["gpu"]
        plain = g["times"]["plain"]
        ratio = statistics.median(a / b for a, b in zip(g["times"]["trainer"], plain))
        floor = statistics.median(a / b for a, b in zip(g["times"]["plain" + AA], plain))
        returns = ", ".join(f"{r * 1e3:.0f} ms" for r in g["returns_s"])
        during, waiting = (statistics.median(a / b for a, b in zip(g[k], g["quiet"])) for k in ("during", "waiting"))
        lines.append(f"GPU ({g['device']}): trainer / plain step {ratio:.3f} (A/A {floor:.3f}); "
                     f"save_checkpoint(blocking=False) of {g['state_bytes'] / 1e9:.2f} GB returned in {returns} "
                     f"(pinned copy {g['pinned_copy_s'] * 1e3:.0f} ms); the {len(g['during'])} blocks of "
                     f"{statistics.median(g['quiet']) * 1e3:.1f} ms/step after the call {during:.3f}x a quiet block "
                     f"({g['in_flight']} ended with the save still writing); {waiting:.3f}x where the GPU has no "
                     "room for its copy of the state and the steps wait for the host copies")
        md.append(f"- {lines[-1]}")
    return md, lines


def preemption_rank(rounds, steps):
    """One of 2 gloo ranks: a DDP MLP through the trainer, timed in blocks of `steps` with the real preemption
    hook on (as shipped: an agreement every AGREE_EVERY_S, at most AGREE_MAX_STEPS apart), on with an agreement
    at every step, off (its handle removed), and on again as an A/A twin, in an order drawn per round from a seed
    both ranks share (their collectives must match). Prints, on rank 0, {variant: [s per step, a block per round]}."""
    import torch

    import seamless_tpu as st

    rounds, steps = int(rounds), int(steps)
    torch.set_num_threads(THREADS)
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    hook = st._STATE.preemption._after_step  # the real post-step hook, as the trainer installed it

    shipped = st.AGREE_MAX_STEPS

    def block(name):
        on, st.AGREE_MAX_STEPS = name != "off", 1 if name == "every step" else shipped
        if on != ("preemption" in st._STATE.optimizer_hooks):
            if on:
                st._add_step_hook("preemption", "post", hook)
            else:
                st._STATE.optimizer_hooks.pop("preemption").remove()
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(trainer.model(x), y).backward()
            optimizer.step()
        return (time.perf_counter() - start) / steps

    rng, times = random.Random(0), {"on": [], "every step": [], "off": [], "on" + AA: []}
    block("on"), block("off")  # warm-up
    for _ in range(rounds):
        for name in rng.sample(list(times), len(times)):
            times[name].append(block(name))
    if torch.distributed.get_rank() == 0:
        report(times)
    torch.distributed.destroy_process_group()


def run_preemption(s):
    rounds, steps = (3, 20) if s.smoke else (40, 100)
    port = random.Random().randrange(20000, 40000)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", USE_TORCH_XLA="0")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "preemption-rank", str(rounds), str(steps)],
            cwd=ROOT,
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("the preemption ranks failed:\n" + "\n".join(err[-2000:] for _, err in outs))
    return result(outs[0][0], "preemption rank 0")


def render_preemption(times, s):
    ratios = {name: [a / b for a, b in zip(times[name], times["off"])] for name in times if name != "off"}
    floor = [a / b for a, b in zip(times["on" + AA], times["on"])]
    extra = statistics.median(times["on"]) - statistics.median(times["off"])
    md = ["2 gloo ranks (CPU), a DDP MLP (64-256-1, batch 32) through the trainer; the preemption hook's real "
          "post-step work on (as shipped: the ranks agree about every 0.25 s, at most 16 steps apart), on with an "
          "agreement at every step, or off, in blocks drawn in a random order each round; A/A: on, twice.", "",
          "| | median s/step | ratio to off [95% interval] |", "|---|---|---|"]
    md += [f"| hook {name} | {statistics.median(times[name]) * 1e6:.0f} us | "
           + ("{:.3f} [{:.3f}, {:.3f}] |".format(*interval(ratios[name]))
              if name in ratios else "1 |") for name in times]
    md += ["", "- A/A floor (on twice): {:.3f} [{:.3f}, {:.3f}]; ".format(*interval(floor)) +
           f"the hook costs {extra * 1e6:+.0f} us per step (median on - median off)"]
    return md, [f"preemption agreement on 2 gloo ranks: {statistics.median(ratios['on']):.3f} of the step without it "
                f"(A/A {statistics.median(floor):.3f}; every step: {statistics.median(ratios['every step']):.3f}), "
                f"{extra * 1e6:+.0f} us per step"]


def ddp_rank(rounds, steps, device):
    """One of 2 gloo ranks on `device` (cpu, or cuda: both ranks on GPU 0): the same MLP (64-512-512-1, batch 32,
    AdamW) in DDP through the trainer, in torch's composable replicate() (what the trainer applies) and in torch's
    DistributedDataParallel with its defaults twice (the A/A floor), timed in blocks of `steps` in an order drawn
    per round from a seed both ranks share. The trainer's preemption hook is off: this compares the DDP wrappers.
    Prints, on rank 0, {variant: [s per step]} and find_unused_parameters of the trainer's DDP after its first step.
    """
    import torch
    from torch.distributed._composable.replicate import replicate

    import seamless_tpu as st

    rounds, steps = int(rounds), int(steps)
    torch.set_num_threads(THREADS)
    torch.distributed.init_process_group("gloo")
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                   torch.nn.ReLU(), torch.nn.Linear(512, 1))

    shim = mlp()
    st.SeamlessTPUTrainer(shim, device=str(dev))
    st._STATE.optimizer_hooks.pop("preemption").remove()
    models = {"trainer": shim}
    for name in ("torch DDP", "torch DDP" + AA):
        models[name] = torch.nn.parallel.DistributedDataParallel(
            mlp().to(dev), device_ids=[0] if dev.type == "cuda" else None)
    models["torch replicate()"] = replicate(mlp().to(dev), device_id=dev)  # the composable DDP the trainer applies
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    x, y = torch.randn(32, 64, device=dev), torch.randn(32, 1, device=dev)

    def block(name):
        model, optimizer = models[name], optimizers[name]
        torch.distributed.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    for name in models:  # warm-up, and the trainer's first step reads which parameters the ranks use
        block(name)
    rng, times = random.Random(0), {name: [] for name in models}
    for _ in range(rounds):
        for name in rng.sample(list(times), len(times)):
            times[name].append(block(name))
    found = replicate.state(shim)._ddp.find_unused_parameters
    if torch.distributed.get_rank() == 0:
        report({"times": times, "find_unused": found})
    torch.distributed.destroy_process_group()


def run_ddp(s):
    """ddp_rank on 2 gloo CPU ranks, and on 2 ranks sharing GPU 0 where CUDA is present."""
    import torch

    rounds, steps = (2, 10) if s.smoke else (30, 50)
    out = {}
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        port = random.Random().randrange(20000, 40000)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", USE_TORCH_XLA="0")
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "ddp-rank", str(rounds),
                                   str(steps), device], cwd=ROOT, env=dict(env, RANK=str(rank)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        outs = [p.communicate(timeout=600) for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("the ddp ranks failed:\n" + "\n".join(err[-2000:] for _, err in outs))
        out[device] = result(outs[0][0], "ddp rank 0")
        out[device]["warned"] = sum("find_unused_parameters=True was specified" in err for _, err in outs)
    return out


def render_ddp(out, s):
    md = ["2 gloo ranks, an MLP (64-512-512-1, batch 32, AdamW): DDP through the trainer (torch's composable "
          "replicate; find_unused_parameters off unless a rank leaves a parameter out at the first step) against "
          "torch's composable replicate() alone and torch's DistributedDataParallel with its defaults, twice (A/A), "
          "in blocks drawn in a random order each round. The trainer's preemption hook is off.", "",
          "| device | variant | median s/step | ratio to torch DDP [95% interval] |", "|---|---|---|---|"]
    lines = []
    for device, r in out.items():
        times, base = r["times"], r["times"]["torch DDP"]
        for name in times:
            ratios = [a / b for a, b in zip(times[name], base)]
            cell = "1" if name == "torch DDP" else "{:.3f} [{:.3f}, {:.3f}]".format(*interval(ratios))
            md.append(f"| {device} | {name} | {statistics.median(times[name]) * 1e6:.0f} us | {cell} |")
        ratio = statistics.median(a / b for a, b in zip(times["trainer"], base))
        floor = statistics.median(a / b for a, b in zip(times["torch DDP" + AA], base))
        lines.append(f"DDP on 2 gloo ranks ({device}): trainer / torch DDP {ratio:.3f} (A/A {floor:.3f}); "
                     f"find_unused_parameters {r['find_unused']}; ranks that printed torch's find_unused warning: "
                     f"{r['warned']}")
    return md + [""] + [f"- {line}" for line in lines], lines


def run_tp(s):
    return tensor_parallel(s.warm, *s.block("transformer", True), s.repeats, random.Random(0))


def run_fsdp(s):
    # XLA transformer blocks; checkpoint calls 5 times (2 in smoke)
    return fsdp_vs_ddp(s.warm, *s.block("transformer", True), s.repeats, 2 if s.smoke else 5, random.Random(0))


CHILDREN = {"import": import_child, "ray-fit": ray_fit_child, "rule-cost": rule_cost_child,  # --child NAME ARGS
            "save-while-training": save_while_training_child, "preemption-rank": preemption_rank,
            "ddp-rank": ddp_rank, "gpu-saves": gpu_saves_child}
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
    global WARM
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
        WARM = True
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
