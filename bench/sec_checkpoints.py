"""Section checkpoints: load cost of a sharded checkpoint on XLA, step time with an asynchronous save in flight
against plain blocks (A/A floor), SIGTERM to an exit with a committed checkpoint, and on a CUDA host the GPU's
asynchronous saves."""

import importlib.util
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from harness import AA, ROOT, TESTS_PATH, XLA_ENV, report, run_child, run_script


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
