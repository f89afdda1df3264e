"""Section ray: wall time of a 2-worker CPU fit under Ray Train, seamless_tpu's TorchConfig against Ray's stock
gloo backend (twice: the A/A floor), each fit on a fresh local cluster in its own process."""

import json
import os
import statistics
import sys
import tempfile
import time

from harness import AA, ROOT, fmt, interval, report, run_child


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
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig

    import seamless_tpu as st

    # ray_fit_loop goes to the Ray workers by value, as it did from bench.py's __main__ before the sections had
    # modules of their own: the workers need not import this module (nor the bench's harness)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
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
