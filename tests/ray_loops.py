"""Train functions that tests/test_ray.py runs on Ray workers. Each writes what it saw to
JSON files under config["out"], which the test (same machine) reads back."""

import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import ray.train
import scenarios
import seamless_tpu as st

ENV_KEYS = ("PJRT_DEVICE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "NODE_RANK", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES") + scenarios.NEVER_READ


def dump(config, name, obj):
    with open(os.path.join(config["out"], f"{name}.json"), "w") as f:
        json.dump(obj, f)


def append(config, name, obj):
    with open(os.path.join(config["out"], f"{name}.jsonl"), "a") as f:
        f.write(json.dumps(obj) + "\n")


def weights(model):
    """Every rank calls it: gathering an FSDP2 (DTensor) parameter is a collective."""
    return [getattr(p, "full_tensor", lambda: p)().detach().cpu().flatten().tolist() for p in model.parameters()]


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x, self.y = scenarios.data(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i, 0], i


def ddp_cpu(config):
    rank = ray.train.get_context().get_world_rank()
    model = scenarios.mlp(seed=rank)  # a different init per rank: DDP must start them equal
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = st.SeamlessTPUTrainer(model)
    loader = trainer.prepare_data_loader(torch.utils.data.DataLoader(Indexed(40), batch_size=4, shuffle=True))
    seen = []
    for _ in range(2):
        epoch = []
        for x, y, idx in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x)[:, 0], y).backward()  # the user's module, as in the plain loop
            optimizer.step()
            epoch += idx.tolist()
        seen.append(epoch)
    dump(
        config,
        f"ddp_{rank}",
        {
            "device_type": st.device_type(),
            "replicated_in_place": trainer.model is model
            and callable(getattr(model, "set_requires_gradient_sync", None)),
            "seen": seen,
            "weights": weights(model),
        },
    )


def xla_plain_loop(config):
    rank = ray.train.get_context().get_world_rank()
    mesh = st.get_xla_mesh()
    losses = scenarios.plain_loop("trainer", "adam").tolist()
    dump(config, f"xla_{rank}", {
        "is_xla": st.is_xla_backend(), "device_type": st.device_type(), "mesh": list(mesh.mesh_shape),
        "axes": list(mesh.axis_names), "losses": losses, "env": {k: os.environ.get(k) for k in ENV_KEYS},
    })


def device_type_only(config):
    dump(config, "routed", {"device_type": st.device_type(), "mesh": list(st.get_xla_mesh().mesh_shape)})


EPOCHS, STEPS = 5, 6


def crash_resume(config):
    """Checkpoints every epoch; the last rank dies mid-epoch 3 once (marker file), then resumes.

    config["sharded"]: the sharded recipe, every worker saving its shards into one directory with
    save_checkpoint and reporting it, and load_checkpoint after a restart. Otherwise trainer.save
    writes one file and rank 0 reports it. config["strategy"] goes to the trainer.
    config["preempt"] (sharded only): instead of dying, the last rank gets a SIGTERM at that point, and
    the README's loop saves at the next step, reports the checkpoint and returns."""
    ctx = ray.train.get_context()
    rank, last_rank = ctx.get_world_rank(), ctx.get_world_size() - 1
    sharded = config.get("sharded", False)
    mesh = st.get_xla_mesh()
    model = scenarios.mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start, skip = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint and not sharded:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])  # a single-process RandomSampler seeds from it
        start = state["epoch"] + 1
    if config.get("preempt"):
        st.AGREE_MAX_STEPS = 1  # the workers agree at every step: the stop lands at a known step in this short run
    trainer = st.SeamlessTPUTrainer(model, optimizer, strategy=config.get("strategy", "ddp"))
    if checkpoint and sharded:
        with checkpoint.as_directory() as d:
            values = trainer.load_checkpoint(d, model=model, optimizer=optimizer)
        torch.set_rng_state(values["rng"])
        start, skip = values["epoch"], values["batches"]  # a preemption's save is mid-epoch
        if skip == STEPS:
            start, skip = start + 1, 0
    append(config, "starts", {"rank": rank, "pid": os.getpid(), "mesh": list(mesh.mesh_shape) if mesh else None,
                              "worker_id": os.environ.get("TPU_WORKER_ID"), "at": [start, skip]})
    loader = trainer.prepare_data_loader(torch.utils.data.DataLoader(
        scenarios._Pairs(STEPS * 4 * ctx.get_world_size()), batch_size=4, shuffle=True))
    loader.set_epoch(start)
    for epoch in range(start, EPOCHS):
        for step, (x, y) in enumerate(loader):
            if epoch == start and step < skip:
                continue
            if (
                (config.get("crash") or config.get("preempt"))
                and epoch == 2
                and step == STEPS // 2
                and rank == last_rank
            ):
                marker = os.path.join(config["out"], "crashed")
                if not os.path.exists(marker):
                    open(marker, "w").close()
                    if config.get("crash"):
                        os._exit(1)
                    os.kill(os.getpid(), signal.SIGTERM)
                    deadline = time.monotonic() + 60  # Ray's main thread runs the handler when it next runs Python
                    while not st._STATE.preemption.sigterm and time.monotonic() < deadline:
                        time.sleep(0.01)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x)[:, 0], y)
            loss.backward()
            optimizer.step()
            if sharded and trainer.preempted:
                directory = os.path.join(config["out"], f"ckpt_{epoch}_preempted")
                trainer.save_checkpoint(directory, model=model, optimizer=optimizer, epoch=epoch, batches=step + 1,
                                        rng=torch.get_rng_state())
                ray.train.report(
                    {"epoch": epoch, "loss": float(loss)}, checkpoint=ray.train.Checkpoint.from_directory(directory)
                )
                append(config, "preempted", {"rank": rank, "pid": os.getpid(), "at": [epoch, step + 1]})
                return
        metrics = {"epoch": epoch, "loss": float(loss)}
        if sharded:
            directory = os.path.join(config["out"], f"ckpt_{epoch}")  # the same directory on every worker
            trainer.save_checkpoint(directory, model=model, optimizer=optimizer, epoch=epoch, batches=STEPS,
                                    rng=torch.get_rng_state())
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
            continue
        directory = os.path.join(config["out"], f"ckpt_{epoch}_{rank}_{time.time_ns()}")
        os.makedirs(directory)
        state = {"model": model, "optimizer": optimizer, "epoch": epoch, "rng": torch.get_rng_state()}
        trainer.save(state, os.path.join(directory, "state.pt"))
        checkpoint = ray.train.Checkpoint.from_directory(directory) if rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint)
    final = weights(model)
    if rank == 0:
        dump(config, "final", {"weights": final, "model": type(model).__name__})


class RecordReports(ray.train.UserCallback):
    """Runs in Ray's controller: records the reports Ray registered (one list entry per rank)."""

    def __init__(self, out):
        self.out = out

    def after_report(self, run_context, metrics, checkpoint):
        append(
            {"out": self.out},
            "reports",
            {"epochs": [m["epoch"] for m in metrics], "checkpoint": checkpoint is not None},
        )
