"""Train a small classifier on a 3-arm spiral with seamless_tpu, on whatever device is there.

The loop below is plain PyTorch: optimizer.step(), no mark_step, no xm.optimizer_step.

    python example_train.py                          # best device: TPU, then GPU, then CPU
    python example_train.py --tpu                    # a TPU VM: pip install 'torch_xla[tpu]==2.9.0'
    python example_train.py --device gpu             # CUDA
    python example_train.py --device cpu             # plain eager CPU
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python example_train.py --device xla
                                                     # real XLA SPMD on 4 virtual CPU devices
    python example_train.py --ray --num-workers 2    # Ray Train, 2 CPU workers (DDP under the hood)
    python example_train.py --ray --num-workers 1 --tpu   # Ray Train on one TPU host (XLA SPMD)
    python example_train.py --tpu --strategy fsdp --checkpoint-dir ckpt
                                                     # parameters sharded over the chips; a sharded
                                                     # checkpoint every epoch, resumed from if present
    python example_train.py --tpu --tp 2 --strategy fsdp
                                                     # tensor parallel: hidden layers split 2 ways over
                                                     # the mesh's model axis, the rest over fsdp (2-D)
    python example_train.py --ray --num-workers 2 --tp 2 --strategy fsdp
                                                     # the same on 2 CPU workers (torch's TP over gloo)

Prints progress through trainer.log() every 5 s (--log-every N: every N steps), the mean loss since the last
line with the run's throughput and, on a TPU or GPU, its MFU:

    INFO seamless_tpu: step 300  loss 0.4127  samples_per_s 2.113e+04  tflops_per_device 0.0001262

then the loss and samples/s for every epoch, the held-out accuracy, the final loss, and on XLA
the compile statistics. --max-steps N stops early (for smoke tests). --precision bf16 trains under
bf16 autocast. --strategy fsdp shards the parameters and optimizer state over the XLA devices, or
with --ray over the CPU/GPU workers (torch's FSDP2); one CPU/GPU process runs it as ddp. --checkpoint-dir DIR
saves a sharded checkpoint after every epoch and, when DIR already holds one, resumes from it (on any device or
strategy) with the same shuffles.
SIGTERM (a spot or preemptible VM going away) stops the run at the next step, every process at the same
one; with --checkpoint-dir it saves there first and a rerun resumes mid-epoch, as if never stopped. Under
--ray with --checkpoint-dir, Ray does the rerun: the preempted attempt fails, and Ray restarts it (up to 3
times) from there.
--accumulate K takes K batches per optimizer step (gradient accumulation: K backward passes, one step);
on XLA each micro-batch is one graph whatever K is. --batch-size 16 --accumulate 4 trains like --batch-size 64.
--tp N adds a model axis of N devices to the mesh and splits the hidden layers over it with the
tensor-parallel plan TP_PLAN (first Linear colwise, second rowwise); the batch then splits over the
other axis. On XLA, or with --ray on CPU/GPU workers (--strategy fsdp: N workers per model group).
The device can also be chosen with SEAMLESS_TPU_DEVICE=tpu|xla|gpu|cpu.
A device that is not there (--tpu on a machine without one) or a bad flag combination prints one
line saying why and exits with status 2.
"""

import argparse
import logging
import math
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from seamless_tpu import SeamlessTPUTrainer, get_device, is_xla_backend

# --- defaults -----------------------------------------------------------------------------------
EPOCHS = 10  # passes over the training set
BATCH_SIZE = 64  # per process; on XLA it is split over the mesh's devices
LR = 1e-2  # Adam
SAMPLES = 3000  # training points (+ 600 held out)
SEED = 0


def spiral(n, seed):
    """Three interleaved spiral arms in 2-D, with labels 0..2."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    r = torch.rand(n, generator=g)
    theta = r * 4 * math.pi + labels * (2 * math.pi / 3) + 0.3 * torch.randn(n, generator=g)
    points = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    return points, labels


TP_PLAN = {"0": "colwise", "2": "rowwise"}  # make_model()'s hidden layers: module name -> how it splits


def make_model():
    return torch.nn.Sequential(
        torch.nn.Linear(2, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 3)
    )


def train(config):
    """One process's training: the same code on TPU, XLA-on-CPU, GPU, CPU and inside Ray workers."""
    torch.manual_seed(config["seed"])
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    tp = {"xla_spmd_config": {"model_parallel_size": config["tp"]}, "tp_plan": TP_PLAN} if config["tp"] > 1 else {}
    trainer = SeamlessTPUTrainer(model, device=config["device"], precision=config["precision"],
                                 strategy=config["strategy"], log_every=config["log_every"], **tp)

    x, y = spiral(config["samples"], seed=config["seed"])
    dataset = torch.utils.data.TensorDataset(x, y)
    shuffle = torch.Generator().manual_seed(config["seed"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=config["batch_size"], shuffle=True, generator=shuffle)
    loader = trainer.prepare_data_loader(loader)
    x_eval, y_eval = trainer.to_device(*spiral(config["samples"] // 5, seed=config["seed"] + 1))

    start, skip, ckpt = 0, 0, config["checkpoint_dir"]
    if ckpt:
        try:
            saved = trainer.load_checkpoint(ckpt, model=model, optimizer=optimizer)
            # A save at an epoch's end resumes at the next epoch; one at a preemption, mid-epoch, resumes
            # in that epoch after the batches it had done (same shuffle, so the same batches).
            start, skip = (saved["epoch"], saved["batches_done"]) if saved["batches_done"] else (saved["epoch"] + 1, 0)
            shuffle.set_state(saved["shuffle"])
            loader.set_epoch(start)
            print(f"resumed from {ckpt} at epoch {start + 1}, batch {skip + 1}", flush=True)
        except FileNotFoundError:  # no checkpoint there yet: a fresh run
            pass

    step, last, accuracy, k = 0, None, float("nan"), config["accumulate"]
    for epoch in range(start, config["epochs"]):
        start, total, batches = time.perf_counter(), 0.0, 0
        epoch_shuffle = shuffle.get_state()  # before this epoch draws its order from it
        for done, (xb, yb) in enumerate(loader):
            if done < skip:
                continue
            with trainer.autocast():
                loss = F.cross_entropy(model(xb).float(), yb)
            # k micro-batches per step; an epoch's last step may have fewer, so divide by its own count
            (loss / min(k, len(loader) - done // k * k)).backward()
            last = loss.detach()
            total, batches = total + last, batches + 1  # the sum stays on the device: no host sync per batch
            if (done + 1) % k and done + 1 < len(loader):
                continue
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            trainer.log(step, loss=last)  # read after the step ran, off the training thread: no stall
            if trainer.preempted:  # SIGTERM (a spot VM going away): the same step on every process
                if ckpt:
                    trainer.save_checkpoint(ckpt, model=model, optimizer=optimizer, epoch=epoch, batches_done=done + 1,
                                            shuffle=epoch_shuffle)
                print(f"preempted in epoch {epoch + 1} after batch "
                      f"{done + 1}" + (f"; saved {ckpt}" if ckpt else ""), flush=True)
                return {"final_loss": float(last), "accuracy": float("nan"), "preempted": True}
            if step == config["max_steps"]:
                break
        skip = 0
        with torch.no_grad():
            accuracy = (model(x_eval).argmax(dim=1) == y_eval).float().mean()
        epoch_loss = float(total / batches)  # one device->host read per epoch
        rate = batches * config["batch_size"] / (time.perf_counter() - start)
        print(f"epoch {epoch + 1}: loss {epoch_loss:.4f}  accuracy {float(accuracy):.3f}  {rate:,.0f} "
              f"samples/s", flush=True)
        if ckpt:
            trainer.save_checkpoint(ckpt, model=model, optimizer=optimizer, epoch=epoch, batches_done=0,
                                    shuffle=shuffle.get_state())
        if step == config["max_steps"]:
            break
    if last is None:
        print(f"nothing left to train: {ckpt} holds epoch {start} of {config['epochs']}", flush=True)
        return {"final_loss": float("nan"), "accuracy": float("nan")}
    final = float(last)
    print(f"final loss {final:.6f} on {trainer.device}", flush=True)
    if is_xla_backend():
        print(f"compiles: {trainer.compile_stats()}", flush=True)
    return {"final_loss": final, "accuracy": float(accuracy)}


def ray_train(config, num_workers):
    """The same train() on Ray Train workers; prints every worker's final loss."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, UserCallback

    from seamless_tpu import TorchTrainer

    def worker(cfg):
        ray.train.report(train(cfg))

    class PrintFinalLoss(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            for rank, m in enumerate(metrics):
                print(f"worker {rank} final loss {m['final_loss']:.6f} accuracy {m['accuracy']:.3f}", flush=True)

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # worker prints once, not twice
    ray.init(num_cpus=max(2, num_workers), include_dashboard=False, log_to_driver=True)
    scaling = ScalingConfig(num_workers=num_workers, use_tpu=config["device"] == "tpu")
    # A preempted attempt saves, then fails so that Ray restarts it; the restart resumes from --checkpoint-dir.
    failures = FailureConfig(max_failures=3 if config["checkpoint_dir"] else 0)
    run = RunConfig(storage_path=tempfile.mkdtemp(prefix="seamless_tpu_example_"), callbacks=[PrintFinalLoss()],
                    failure_config=failures)
    TorchTrainer(worker, train_loop_config=config, scaling_config=scaling, run_config=run).fit()
    ray.shutdown()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, as for every other usage error below
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse says "invalid int value: 'x'"
    return parse


def main(argv=None):
    p = Parser(prog="example_train.py", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "tpu", "xla", "gpu", "cpu"], default=None,
                   help="default: SEAMLESS_TPU_DEVICE, else auto")
    p.add_argument("--tpu", action="store_true", help="same as --device tpu")
    p.add_argument("--epochs", type=positive(int), default=EPOCHS)
    p.add_argument("--batch-size", type=positive(int), default=BATCH_SIZE)
    p.add_argument("--lr", type=positive(float), default=LR)
    p.add_argument("--samples", type=positive(int), default=SAMPLES)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--max-steps", type=positive(int), default=None, help="stop after this many optimizer steps")
    p.add_argument("--log-every", type=positive(int), default=None,
                   help="a progress line every N optimizer steps (default: every 5 s)")
    p.add_argument("--precision", choices=["bf16"], default=None)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="fsdp: shard parameters over the XLA "
                                                                              "devices")
    p.add_argument("--tp", type=positive(int), default=1, help="tensor-parallel size: devices on the mesh's model "
                                                               "axis (XLA)")
    p.add_argument("--accumulate", type=positive(int), default=1, help="micro-batches (backward passes) per "
                                                                       "optimizer step")
    p.add_argument("--checkpoint-dir", default=None, help="save a sharded checkpoint every epoch; resume from it if "
                                                          "present")
    p.add_argument("--ray", action="store_true", help="run under Ray Train's TorchTrainer")
    p.add_argument("--num-workers", type=positive(int), default=None, help="Ray workers (default 2; needs --ray)")
    args = p.parse_args(argv)
    if args.tpu and args.device not in (None, "tpu"):
        p.error(f"--tpu and --device {args.device} ask for two devices; pass one of them")
    if args.num_workers is not None and not args.ray:
        p.error("--num-workers needs --ray")
    workers = args.num_workers or 2
    off_xla = not args.tpu and args.device != "tpu"
    if args.tp > 1 and args.ray and off_xla and (args.strategy != "fsdp" or workers % args.tp):
        p.error(f"--tp {args.tp} on Ray CPU/GPU workers runs torch's tensor parallelism then FSDP2: it needs "
                f"--strategy fsdp "
                f"and --num-workers a multiple of {args.tp}")
    if args.samples < 2 * args.batch_size:
        p.error(f"--samples {args.samples} gives no full batch of --batch-size {args.batch_size}; use at least twice "
                f"the batch size")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    config = {k: getattr(args, k) for k in ("device", "epochs", "batch_size", "lr", "samples", "seed", "max_steps",
                                            "precision", "strategy", "tp", "accumulate", "log_every")}
    # Ray workers chdir into a run directory: the path must be absolute
    config["checkpoint_dir"] = os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.tpu:
        config["device"] = "tpu"
    if args.ray:
        return ray_train(config, workers)
    try:
        device = get_device(config["device"])  # a missing device is a usage error, not a traceback
    except (RuntimeError, ValueError, ImportError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if args.tp > 1 and not is_xla_backend():
        p.error(f"--tp {args.tp} splits layers over an XLA mesh; the device here is {device} (use --tpu or --device "
                f"xla)")
    return train(config)


if __name__ == "__main__":
    main()
