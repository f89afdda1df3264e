"""Loops that a SIGTERM reaches at each phase (tests/test_state.py and tests/test_real_xla.py drive them).

    python tests/sigterm.py PHASE DIR   # writes DIR/ready-RANK when the phase is reached, then waits there

PHASE is where the signal lands (a process run() signals waits there for it, at a known point: faults.await_sigterm):
    step      inside a training step (step 3's forward writes ready and waits for the signal): saves at the end of
              that step, exits 0
    between   between steps 3 and 4: saves at the next step, exits 0
    after     after the loop ended, in a long post-processing: SIGTERM's default exit after the grace
    loading   in a data-loading call that stalls: the default exit after the grace
    eval      in an evaluation-only loop (no optimizer step ever): the default exit after the grace
    probe     (gloo ranks) rank 0 also steps a probe's optimizer every iteration; every rank stops at one step
    slice     (real XLA, 2 processes, no torch.distributed) a user's SIGTERM handler on every rank; the ranks
              agree over the trainer's own gloo group, and rank 0 exits first
Each reports (child.report) {"stopped_at": step or None, "handled": [signals the user's handler saw]} when it returns.
"""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import child
import faults
import seamless_tpu as st

STEPS = 200  # more than any test lets run: every phase ends by the signal


SIGNALLED = "SIGTERM_SIGNALLED"  # set (to "1") in the env of each process run() sends SIGTERM to


class Slow(torch.nn.Module):
    """A model whose forward at call `at` says it has started, then waits for the signal: the signal lands in it."""

    def __init__(self, ready, at):
        super().__init__()
        self.net, self.ready, self.at, self.calls = torch.nn.Linear(10, 1), ready, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            faults.await_sigterm(self.ready)
        return self.net(x)


def run(phase, directory, world=1, env=None, timeout=120, to_all=False):
    """tests/sigterm.py PHASE on `world` processes (gloo ranks, or 2 XLA processes for 'slice'); SIGTERM to the
    last one (to every one with `to_all`, as when a whole slice goes) once every rank is at the phase. Per
    process: (exit code, seconds from the signal to its exit, its report or None, stderr)."""
    import subprocess

    import child
    import preempt

    base = child.env(**{"SEAMLESS_TPU_DEVICE": "cpu", "SEAMLESS_TPU_SIGTERM_GRACE": str(GRACE), **(env or {})})
    port = preempt.free_port()
    envs = [dict(base, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 SEAMLESS_TPU_PORT=str(port)) for r in range(world)]
    for e in envs if to_all else envs[-1:]:
        e[SIGNALLED] = "1"
    procs = [child.popen(["tests/sigterm.py", phase, directory], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True) for e in envs]
    try:
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(os.path.join(directory, f"ready-{r}")) for r in range(world)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise AssertionError(f"tests/sigterm.py {phase} never reached its phase: "
                                     + "".join(p.communicate()[1][-2000:] for p in procs if p.poll() is not None))
            time.sleep(0.02)
        for p in procs if to_all else procs[-1:]:
            p.send_signal(signal.SIGTERM)
        sent, outs = time.monotonic(), []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, time.monotonic() - sent, child.result(out, required=False), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


GRACE = 2.0  # seconds: what the tests set SEAMLESS_TPU_SIGTERM_GRACE to


def main(phase, directory):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and phase != "slice":
        torch.distributed.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    ready = os.path.join(directory, f"ready-{rank}")
    handled = []
    if phase == "slice":  # the runtime's answers on a 2-host slice; everything else is real
        st._xla_processes = lambda: (world, rank, "127.0.0.1")
        signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(signum))
    torch.manual_seed(0)
    model = Slow(ready, 4 if phase == "step" else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = st.SeamlessTPUTrainer(model)
    probe = torch.nn.Linear(10, 1)  # a helper only rank 0 trains: its steps are not the trainer's
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.01)

    def batches():
        for step in range(STEPS):
            if phase == "loading" and step == 3:
                open(ready, "w").close()
                time.sleep(120)  # a stalled read: a network file system, a dead data worker
            yield torch.randn(8, 10), torch.randn(8, 1)

    stopped = None
    if phase == "eval":
        model.eval()
        with torch.no_grad():
            for step in range(STEPS):
                model(trainer.to_device(torch.randn(8, 10)))
                if step == 3:
                    open(ready, "w").close()
                time.sleep(0.1)
    else:
        for step, (x, y) in enumerate(batches()):
            x, y = trainer.to_device(x, y)
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            if phase == "probe" and rank == 0:
                probe_optimizer.zero_grad()
                probe(torch.randn(4, 10)).sum().backward()
                probe_optimizer.step()
            if trainer.preempted:
                trainer.save_checkpoint(
                    os.path.join(directory, "ckpt"), model=model, step=step
                ) if phase != "slice" else None
                stopped = step
                break
            if step == 3 and phase in ("between", "probe", "slice"):
                faults.await_sigterm(ready) if os.environ.get(SIGNALLED) else open(ready, "w").close()
        if phase == "after":
            open(ready, "w").close()
            time.sleep(120)  # post-processing, an upload, or a bug: the exit must still come
    child.report({"stopped_at": stopped, "handled": handled})
    if phase == "slice" and rank == 1:
        time.sleep(2)  # the leader (rank 0) exits first: the others must not die of it
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
