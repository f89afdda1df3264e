"""Section overhead: the shim's own Python work per optimizer step (its global optimizer hooks, called back to
back with no device work), on XLA and on the eager CPU."""

import time

from harness import EAGER_ENV, XLA_ENV, ask_once


def shim_overhead(variant, reps=20000):
    """The shim's own Python work per optimizer step, timed in isolation: its one global pre-step and one post-step
    hook, called back to back. On XLA with torch_xla.sync stubbed out (no device work): the watchdog's count, the
    first step's check and the cuts; everywhere the optimizer's record (a parameter count), the rebinding check, and
    preemption and the meter (one process: a flag read, a few attribute writes)."""
    from torch.optim import optimizer as optim_module

    import seamless_tpu as st

    hooks = len(optim_module._global_optimizer_pre_hooks) + len(optim_module._global_optimizer_post_hooks)
    opt = variant.optimizer
    calls = [lambda: st._before_step(opt, (), {}), lambda: st._after_step(opt, (), {})]
    sync = None
    if st.is_xla_backend():
        import torch_xla

        sync, torch_xla.sync = torch_xla.sync, lambda *args, **kwargs: None
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


def run_overhead(s):
    return {label: ask_once("shim", env, "overhead") for label, env in (("xla", XLA_ENV), ("eager_cpu", EAGER_ENV))}


def render_overhead(overhead, s):
    md = ["The shim's one pre-step and one post-step hook (`_before_step`, `_after_step`), called back to back: "
          "everywhere the optimizer's record, rebinding's check, preemption and the meter; on XLA also the watchdog, "
          "the first step's check and the cuts, with `torch_xla.sync` replaced by a no-op, so no device work is "
          "timed.", ""]
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
