"""A run that a SIGTERM preempts, as a spot TPU VM is (test_seamless_tpu.py and test_real_xla.py drive it).

    python tests/preempt.py uninterrupted DIR   # STEPS steps; reports {"losses": [...], ...}
    python tests/preempt.py preemptible DIR     # writes DIR/ready-RANK after step 3 (the process run() signals
                                                # waits there for the SIGTERM), then steps until trainer.preempted,
                                                # saves DIR/ckpt and exits 0
    python tests/preempt.py saving DIR          # the same, with a periodic save at step 5 whose commit writes
                                                # DIR/saving-0, then waits for DIR/signalled (run() writes it
                                                # once its signals are sent): they land while it commits
    python tests/preempt.py resume DIR          # loads DIR/ckpt and runs the remaining steps

run(MODE, DIR, N) runs one of these on N processes for a test, and can SIGTERM one of them. Each reports
(child.report) {"losses": [...], "stopped_at": step or None, "start": first step}.

With WORLD_SIZE > 1 (RANK, MASTER_ADDR, MASTER_PORT set) each process is one gloo rank and trains on
its half of every batch. The loop is the README's: `if trainer.preempted: save_checkpoint(...); break`.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import child
import faults
import seamless_tpu as st

STEPS = 40
SIGNALLED = "PREEMPT_SIGNALLED"  # set (to "1") in the env of the process run() sends SIGTERM to


def batch(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        x, y = x.chunk(2)[rank], y.chunk(2)[rank]
    return x, y


def run(mode, directory, world, signal_rank=None, env=None, signals=1):
    """tests/preempt.py MODE on `world` processes (gloo ranks when 2); with signal_rank, SIGTERM that
    process `signals` times once every rank is past step 3 (mode 'saving': once the step-5 save is
    committing). Each process's report."""
    port = free_port()
    base = child.env(**{"SEAMLESS_TPU_DEVICE": "cpu", **(env or {})})
    envs = [
        dict(base, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if world > 1
        else dict(base)
        for r in range(world)
    ]
    if signal_rank is not None:
        envs[signal_rank][SIGNALLED] = "1"
    procs = [
        child.popen(
            ["tests/preempt.py", mode, directory], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for e in envs
    ]
    try:
        if signal_rank is not None:
            deadline = time.monotonic() + 120
            flags = ["saving-0"] if mode == "saving" else [f"ready-{r}" for r in range(world)]
            while not all(os.path.exists(os.path.join(directory, f)) for f in flags):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                    f"the run never wrote {flags}"
                )
                time.sleep(0.05)
            for i in range(signals):
                procs[signal_rank].send_signal(signal.SIGTERM)
                if i + 1 < signals:
                    # two signals, not one: a second sent before the first is handled would merge with it
                    time.sleep(0.2)
            open(os.path.join(directory, "signalled"), "w").close()  # sent: the held commit may end
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, outs):
        child.assert_ok(p.returncode, out, err, f"preempt.py {mode}")
    return [child.result(out) for out, _ in outs]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(mode, directory):
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = st.SeamlessTPUTrainer(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    start, losses, stopped = 0, [], None
    if mode == "resume":
        state = trainer.load_checkpoint(os.path.join(directory, "ckpt"), model=model, optimizer=optimizer)
        start = state["step"] + 1
        torch.set_rng_state(state["rng"])
    for step in range(start, STEPS):
        x, y = trainer.to_device(*batch(step))
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if mode == "saving" and step == 5:  # a periodic save, which the signals interrupt
            with faults.slow_commit(
                started=os.path.join(directory, "saving-0"), until=os.path.join(directory, "signalled")
            ):
                trainer.save_checkpoint(os.path.join(directory, "ckpt"), model=model, optimizer=optimizer, step=step,
                                        rng=torch.get_rng_state())
        if mode in ("preemptible", "saving"):
            if step == 3:
                ready = os.path.join(directory, f"ready-{rank}")
                if mode == "preemptible" and os.environ.get(SIGNALLED):
                    faults.await_sigterm(ready)  # the signal lands between steps 3 and 4
                else:
                    open(ready, "w").close()
            if trainer.preempted:
                trainer.save_checkpoint(os.path.join(directory, "ckpt"), model=model, optimizer=optimizer, step=step,
                                        rng=torch.get_rng_state())
                stopped = step
                break
    child.report({"losses": [float(v) for v in losses], "stopped_at": stopped, "start": start})
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
