"""One rank of a 2-process gloo world on CPU, for the fast tier (test_seamless_tpu.py runs two).

    python tests/dist_ranks.py CASE RANK WORLD_SIZE STORE_FILE OUT_DIR

Reports (child.report) what this rank saw.
"""

import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import child
import faults
import seamless_tpu as st


def save_errors(out_dir):
    """A save that fails on process 0 raises on every rank, with process 0's reason."""
    model = torch.nn.Linear(3, 2)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    seen = {}
    for case, path, obj in (
        ("missing_dir", os.path.join(out_dir, "no", "such", "dir", "ckpt.pt"), {"model": model}),
        ("unpicklable", os.path.join(out_dir, "ckpt.pt"), {"model": model, "fn": lambda: 0}),
    ):
        try:
            trainer.save(obj, path)
            seen[case] = None
        except Exception as e:
            seen[case] = f"{type(e).__name__}: {e}"
    trainer.save({"model": model}, os.path.join(out_dir, "ok.pt"))  # the group still works afterwards
    seen["ok_exists"] = os.path.exists(os.path.join(out_dir, "ok.pt"))
    return seen


def agreement(out_dir):
    """The one agreement step: every rank gets process 0's value; a failure on any rank (here process
    1) raises on every rank, with that rank's reason, and the group still works afterwards."""
    rank = dist.get_rank()
    seen = {"value": st._agree("pick", value=f"from process {rank}")}
    try:
        st._agree("step", error=OSError("disk full") if rank == 1 else None)
        seen["failed"] = None
    except Exception as e:
        seen["failed"] = f"{type(e).__name__}: {e}"
    seen["after"] = st._agree("again", value=rank)
    return seen


class Heads(torch.nn.Module):
    """A trunk and two task heads: a step may use either head (multi-task, conditional branches), or the sum of
    several (a tuple of heads)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.heads = (
            torch.nn.Linear(4, 8),
            torch.nn.ModuleList([torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)]),
        )

    def forward(self, x, head=0):
        h = torch.tanh(self.trunk(x))
        return sum(self.heads[i](h) for i in head) if isinstance(head, tuple) else self.heads[head](h)


def heads_model():
    torch.manual_seed(0)
    model = Heads()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def full_batch(step, world, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(4 * world, 4, generator=g), torch.randn(4 * world, 1, generator=g)


def flat(model):
    return torch.cat(
        [getattr(p, "full_tensor", lambda p=p: p)().detach().reshape(-1) for p in model.parameters()]
    ).tolist()


def sync_loop(model, optimizer, call, rank, world, head_of, accumulate=1, evaluate=False, steps=4, device="cpu"):
    """The user's loop on this rank's rows (moved to `device`): backward (k micro-batches, all but the last under
    model.no_sync()), clip_grad_norm_ between backward and step, an optional no-grad eval pass."""
    norms = []
    for step in range(steps):
        for micro in range(accumulate):
            x, y = full_batch(step, world, micro)
            x, y = x[4 * rank:4 * rank + 4].to(device), y[4 * rank:4 * rank + 4].to(device)
            quiet = micro < accumulate - 1
            with call.no_sync() if quiet else contextlib.nullcontext():
                (F.mse_loss(call(x, head_of(rank, step)), y) / accumulate).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(getattr(norm, "full_tensor", lambda: norm)()))  # FSDP2: a DTensor of local parts
        optimizer.step()
        optimizer.zero_grad()
        if evaluate:
            with torch.no_grad():
                call(torch.ones(2, 4, device=device), 0)
    return {"norms": norms, "weights": flat(model)}


def eager_loop(world, head_of, accumulate=1, steps=4):
    """The reference: one process, the whole batch, the mean of the ranks' losses."""
    model, optimizer = heads_model()
    norms = []
    for step in range(steps):
        for micro in range(accumulate):
            x, y = full_batch(step, world, micro)
            loss = sum(
                F.mse_loss(model(x[4 * r : 4 * r + 4], head_of(r, step)), y[4 * r : 4 * r + 4]) for r in range(world)
            )
            (loss / world / accumulate).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "weights": flat(model)}


def kept_trainer(strategy):
    model, optimizer = heads_model()
    return model, optimizer, st.SeamlessTPUTrainer(model, device="cpu", strategy=strategy)


def dropped_trainer(strategy):
    """A trainer made inside a setup helper and not kept: behaviour must not depend on it."""
    model, optimizer, _ = kept_trainer(strategy)
    gc.collect()
    return model, optimizer, None


def grad_sync(out_dir):
    """Gradient averaging for every way a loop calls the model, against torch's DDP and against
    single-process eager on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    same_head, own_head = (lambda r, step: 0), (lambda r, step: (r + step) % 2)
    seen = {}
    for name, make, call, head_of, kwargs in (
        ("trainer.model", kept_trainer, "trainer", same_head, {}),
        ("original module", kept_trainer, "model", same_head, {}),
        ("heads differ per rank", kept_trainer, "model", own_head, {}),
        ("no_sync accumulation", kept_trainer, "model", same_head, {"accumulate": 3}),
        ("eval passes", kept_trainer, "model", same_head, {"evaluate": True}),
        ("trainer not kept", dropped_trainer, "model", own_head, {}),
        ("trainer not kept, one head", dropped_trainer, "model", same_head, {}),
        ("torch DDP", None, "ddp", own_head, {"accumulate": 2}),
    ):
        # FSDP2 needs every rank to run each unit's forward (its reduce-scatter is collective): one head.
        for strategy in ("ddp", "fsdp") if name in ("trainer not kept, one head", "original module") else ("ddp",):
            if make is None:
                model, optimizer = heads_model()
                target = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
            else:
                model, optimizer, trainer = make(strategy)
                target = trainer.model if call == "trainer" else model
            got = sync_loop(model, optimizer, target, rank, world, head_of, **kwargs)
            want = eager_loop(world, head_of, kwargs.get("accumulate", 1))
            seen[f"{name} ({strategy})"] = {
                "weights_diff": max(abs(a - b) for a, b in zip(got["weights"], want["weights"])),
                "norms_diff": max(abs(a - b) for a, b in zip(got["norms"], want["norms"])),
                "weights": got["weights"],
            }
    return seen


def unused_parameters(out_dir):
    """DDP through the trainer on a model whose ranks use every parameter ("all", then torch's DDP warning about
    find_unused_parameters must not appear, and DDP walks no graph) or where rank 1 always leaves head 1 out ("rank
    1 skips"; run alone: torch warns on a rank that used everything once find_unused_parameters is on). Both train
    like one process on the whole batch. On SEAMLESS_TPU_DEVICE (the gpu tier: both ranks on one GPU)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = os.environ["UNUSED_CASE"]
    head_of = (lambda r, step: (0, 1)) if case == "all" else (lambda r, step: (0,) if r == 1 else (0, 1))
    model, optimizer = heads_model()
    trainer = st.SeamlessTPUTrainer(model, device=os.environ["SEAMLESS_TPU_DEVICE"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # on the device's parameters
    state = __import__("torch.distributed._composable.replicate", fromlist=["_"]).replicate.state(model)
    before = state._ddp.find_unused_parameters
    got = sync_loop(model, optimizer, model, rank, world, head_of, accumulate=2, device=trainer.device)
    want = eager_loop(world, head_of, accumulate=2)
    return {"find_unused_before": before, "find_unused_after": state._ddp.find_unused_parameters,
            "weights_diff": max(abs(a - b) for a, b in zip(got["weights"], want["weights"])),
            "norms_diff": max(abs(a - b) for a, b in zip(got["norms"], want["norms"])),
            "weights": got["weights"]}


class Repeated(torch.nn.Module):
    """One block applied three times through ModuleList([blk, blk, blk]): weight sharing by repetition."""

    def __init__(self):
        super().__init__()
        blk = torch.nn.Linear(8, 8)
        self.inp, self.blocks, self.out = (
            torch.nn.Linear(4, 8),
            torch.nn.ModuleList([blk, blk, blk]),
            torch.nn.Linear(8, 1),
        )

    def forward(self, x, head=0):
        x = self.inp(x)
        for blk in self.blocks:
            x = torch.tanh(blk(x))
        return self.out(x)


def repeated_block(out_dir):
    """strategy='fsdp' shards each distinct module once and trains like eager on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build():
        torch.manual_seed(0)
        model = Repeated()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, optimizer = build()
    st.SeamlessTPUTrainer(model, device="cpu", strategy="fsdp")
    got = sync_loop(model, optimizer, model, rank, world, lambda r, step: 0)
    eager, eager_opt = build()
    for step in range(4):
        x, y = full_batch(step, world, 0)
        F.mse_loss(eager(x), y).backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        eager_opt.step()
        eager_opt.zero_grad()
    return {"weights_diff": max(abs(a - b) for a, b in zip(got["weights"], flat(eager))), "weights": got["weights"]}


def checkpoint_objects(out_dir):
    """On real ranks: an optimizer without state, a scheduler, a GradScaler and a user object round-trip
    through save_checkpoint (ddp and FSDP2); a full disk on process 1 raises an ordinary exception on
    every rank, and the previous checkpoint stays the loaded one."""
    rank = dist.get_rank()
    seen = {}
    for strategy in ("ddp", "fsdp"):
        directory = os.path.join(out_dir, strategy)
        model, optimizer = heads_model()
        trainer = st.SeamlessTPUTrainer(model, device="cpu", strategy=strategy)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        scaler.scale(torch.ones(()))
        scheduler.step()
        trainer.save_checkpoint(
            directory, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, epoch=1
        )
        model2, optimizer2 = heads_model()
        trainer2 = st.SeamlessTPUTrainer(model2, device="cpu", strategy=strategy)
        scheduler2, scaler2 = (
            torch.optim.lr_scheduler.StepLR(optimizer2, step_size=1, gamma=0.5),
            torch.amp.GradScaler("cpu"),
        )
        plain = trainer2.load_checkpoint(
            directory, model=model2, optimizer=optimizer2, scheduler=scheduler2, scaler=scaler2
        )
        seen[strategy] = {"epoch": plain["epoch"], "lr": optimizer2.param_groups[0]["lr"], "scale": scaler2.get_scale(),
                          "scheduler_epoch": scheduler2.last_epoch}
        fsync = os.fsync
        if rank == 1:
            os.fsync = lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        try:
            trainer.save_checkpoint(directory, model=model, epoch=2)
            seen[strategy]["disk_full"] = None
        except Exception as e:  # noqa: BLE001 (the point: an ordinary exception)
            seen[strategy]["disk_full"] = f"{type(e).__name__}: {e}"
        finally:
            os.fsync = fsync
        seen[strategy]["after"] = trainer2.load_checkpoint(directory, model=model2)["epoch"]
    return seen


def async_checkpoint(out_dir):
    """On real ranks (ddp and FSDP2): save_checkpoint(..., blocking=False) while the loop trains on, its
    gradient all-reduces and FSDP2 gathers on the default group, the save's planning on a group of its
    own. Every rank's future resolves; the checkpoint holds the weights at the call."""
    import scenarios

    seen = {}
    for strategy in ("ddp", "fsdp"):
        directory = os.path.join(out_dir, f"async-{strategy}")
        model, optimizer = heads_model()
        trainer = st.SeamlessTPUTrainer(model, device="cpu", strategy=strategy)
        x, y = full_batch(0, dist.get_world_size(), 0)
        x, y = x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[dist.get_rank()]
        scenarios.run_steps(model, optimizer, x, y, 2)
        at_call = {k: getattr(v, "full_tensor", lambda v=v: v)().clone() for k, v in model.state_dict().items()}
        with faults.slow_commit(1):  # a write that takes a second
            future = trainer.save_checkpoint(directory, blocking=False, model=model, optimizer=optimizer, epoch=2)
            scenarios.run_steps(model, optimizer, x, y, 5)  # the loop goes on: the same steps on every rank
            in_flight = not future.done()
            future.result()
        model2, optimizer2 = heads_model()
        trainer2 = st.SeamlessTPUTrainer(model2, device="cpu", strategy=strategy)
        epoch = trainer2.load_checkpoint(directory, model=model2, optimizer=optimizer2)["epoch"]
        loaded = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in model2.state_dict().items()}
        seen[strategy] = {"result": os.path.basename(future.result()), "epoch": epoch, "in_flight": in_flight,
                          "at_call": all(torch.equal(loaded[k], at_call[k]) for k in at_call)}
    return seen


def tensor_parallel(out_dir):
    """4 ranks as 2 fsdp x 2 model with a plan: torch's tensor parallelism then FSDP2, the optimizer made
    before the trainer, the loop unchanged; like eager on the whole batch. Ranks of one tensor-parallel
    group read the same batches."""
    import scenarios

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = scenarios.mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = st.SeamlessTPUTrainer(model, device="cpu", strategy="fsdp", xla_spmd_config={"model_parallel_size": 2},
                                    tp_plan=scenarios.MLP_PLAN)
    data_rank = rank // 2
    losses = []
    for step in range(6):
        x, y = scenarios.data(8, seed=step)
        loss = F.mse_loss(model(x[4 * data_rank:4 * data_rank + 4]), y[4 * data_rank:4 * data_rank + 4])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    eager = scenarios.mlp()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step in range(6):
        x, y = scenarios.data(8, seed=step)
        F.mse_loss(eager(x), y).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    seen = {
        "weights_diff": max(abs(a - b) for a, b in zip(flat(model), flat(eager))),
        "split": [tuple(p.to_local().shape) for p in model.parameters()],
        "describe": trainer.describe(optimizer),
        "describe_wrong": scenarios.describe_mismatches(trainer, model),
        "batches": [
            b.tolist() for b in trainer.prepare_data_loader(torch.utils.data.DataLoader(list(range(16)), batch_size=2))
        ],
    }
    try:
        st.SeamlessTPUTrainer(
            scenarios.mlp(), device="cpu", xla_spmd_config={"model_parallel_size": 2}, tp_plan=scenarios.MLP_PLAN
        )
    except NotImplementedError as e:
        seen["ddp_error"] = str(e)
    return seen


def tensor_parallel_llama(out_dir):
    """A transformers Llama with its own plan on 4 ranks (2 fsdp x 2 model): eager's losses on the whole batch."""
    import workloads

    rank = dist.get_rank()
    data_rank = rank // 2
    losses = {}
    for name in ("tp", "eager"):
        model = workloads.tiny_lm("llama")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if name == "tp":
            st.SeamlessTPUTrainer(model, device="cpu", strategy="fsdp", xla_spmd_config={"model_parallel_size": 2})
        losses[name] = []
        for step in range(6):
            ids = torch.randint(
                0, workloads.LM_VOCAB, (4, workloads.LM_SEQ), generator=torch.Generator().manual_seed(step)
            )
            part = ids[2 * data_rank:2 * data_rank + 2] if name == "tp" else ids
            loss = model(input_ids=part, labels=part).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if name == "tp":  # the whole batch's loss: the mean over the data groups
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= dist.get_world_size()
            losses[name].append(loss.item())
    return {"diff": max(abs(a - b) for a, b in zip(losses["tp"], losses["eager"])), "losses": losses}


def loaders(out_dir):
    """prepare_data_loader on real ranks: a user's DistributedSampler kept, batch_size=None split."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = st.SeamlessTPUTrainer(torch.nn.Linear(1, 1), device="cpu")
    data = list(range(16))
    own = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    seen = {
        "own_sampler": [
            x
            for b in trainer.prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=2, sampler=own))
            for x in b.tolist()
        ],
        "unbatched": [int(x) for x in trainer.prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=None))],
    }
    return seen


def user_ddp(out_dir):
    """A model the user wrapped in DDP is used as is: one all-reduce, the user's keys."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1.0)
    trainer = st.SeamlessTPUTrainer(ddp, device="cpu")
    rank = dist.get_rank()
    x = torch.full((1, 3), float(rank + 1))  # rank 0 sees 1s, rank 1 sees 2s
    optimizer.zero_grad()
    trainer.model(x).sum().backward()
    optimizer.step()
    path = os.path.join(out_dir, "ddp.pt")
    trainer.save({"model": trainer.model}, path)
    return {"same_object": trainer.model is ddp, "weight": model.weight.detach().tolist(),
            "keys": sorted(torch.load(path)["model"])}


def fsdp2_idioms(out_dir):
    """strategy='fsdp' on 2 gloo ranks (FSDP2): the idioms of real loops, and its errors."""
    seen = {}
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    try:
        st.SeamlessTPUTrainer(ddp, device="cpu", strategy="fsdp")
    except ValueError as e:
        seen["ddp_error"] = str(e)

    class Net(torch.nn.Sequential):
        def forward(self, x):
            return self[2](self[1][0](self[0](x)))

    def build():
        torch.manual_seed(0)
        return Net(torch.nn.Linear(4, 8), torch.nn.ModuleList([torch.nn.Linear(8, 8)]), torch.nn.Linear(8, 1))

    def forward(model, x):
        return model(x)

    # An optimizer with state before the trainer exists (resumed from a plain checkpoint).
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    forward(model, torch.ones(2, 4)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}
    trainer = st.SeamlessTPUTrainer(model, device="cpu", strategy="fsdp")
    seen["unit"] = type(model[1][0]).__name__
    seen["old_params_until_step"] = optimizer.param_groups[0]["params"][0] is not model[0].weight
    later = torch.optim.SGD(model.parameters(), lr=0.0)  # made after the trainer: the new parameters already
    rank = dist.get_rank()
    x = torch.full((2, 4), float(rank + 1))
    optimizer.zero_grad()
    forward(model, x).sum().backward()
    seen["clip_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor())
    optimizer.step()
    later.step()
    seen["adopted"] = optimizer.param_groups[0]["params"][0] is model[0].weight
    moved = optimizer.state[model[0].weight]
    seen["state_sharded"] = type(moved["exp_avg"]).__name__ == "DTensor" and moved["exp_avg"].to_local().shape[0] == 4
    seen["state_kept"] = bool(torch.equal(before["step"] + 1, moved["step"]))
    path = os.path.join(out_dir, "fsdp2.pt")
    trainer.save({"model": model, "optimizer": optimizer}, path)
    saved = torch.load(path)
    seen["save_keys"] = sorted(saved["model"])
    seen["save_shapes"] = [list(v.shape) for v in saved["model"].values()]
    seen["weight0"] = model[0].weight.full_tensor().tolist()
    directory = os.path.join(out_dir, "ckpt")
    trainer.save_checkpoint(directory, model=model, optimizer=optimizer, epoch=1)
    wrong = Net(torch.nn.Linear(4, 9), torch.nn.ModuleList([torch.nn.Linear(9, 8)]), torch.nn.Linear(8, 1))
    try:
        st.SeamlessTPUTrainer(wrong, device="cpu", strategy="fsdp").load_checkpoint(directory, model=wrong)
    except ValueError as e:
        seen["shape_error"] = str(e)
    return seen


def meta_fsdp2(out_dir):
    """A 151 MB model built under torch.device("meta") with strategy='fsdp' on 2 gloo ranks (FSDP2): each
    module is initialised on the CPU in turn and each rank keeps only its shards. The weights are a CPU
    build's (sha1 of each gathered tensor); the optimizer made on meta trains them."""
    import hashlib

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Embedding(4096, 1024),
            torch.nn.LayerNorm(1024),
            *[torch.nn.Linear(1024, 4096) if i % 2 == 0 else torch.nn.Linear(4096, 1024) for i in range(8)],
        )

    def digests(state):
        return {k: hashlib.sha1(v.numpy().tobytes()).hexdigest() for k, v in state.items()}

    seen = {"cpu": digests(build().state_dict())}
    gc.collect()
    with torch.device("meta"):
        model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = child.kib("VmRSS")
    st.SeamlessTPUTrainer(model, device="cpu", strategy="fsdp")
    seen["growth"] = child.kib("VmHWM") - before
    params = dict(model.named_parameters())
    seen["bytes"] = sum(p.numel() * p.element_size() for p in params.values())
    seen["local_bytes"] = sum(p.to_local().numel() * p.element_size() for p in params.values())
    seen["largest_module"] = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    seen["all_dtensor"] = all(
        type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in params.values()
    )
    seen["meta"] = digests(
        {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    )
    before = model[-1].weight.full_tensor()
    model(torch.arange(4).reshape(2, 2)).sum().backward()
    optimizer.step()
    seen["trained"] = not torch.equal(before, model[-1].weight.full_tensor())
    return seen


def meta_unset_fsdp2(out_dir):
    """scenarios.Scaled built on meta, strategy='fsdp' on 2 gloo ranks (FSDP2, each module initialised into
    this rank's shards): the forward and a save are refused on every rank, naming '0' and 'scale', until
    load_checkpoint fills it from a CPU build's checkpoint; then the outputs are the CPU build's."""
    import scenarios

    cpu = scenarios.scaled_net(seed=1)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    want = cpu(x)
    directory = os.path.join(out_dir, "ckpt")
    st.SeamlessTPUTrainer(cpu, device="cpu", strategy="fsdp").save_checkpoint(directory, model=cpu)
    with torch.device("meta"):
        model = scenarios.scaled_net()
    trainer = st.SeamlessTPUTrainer(model, device="cpu", strategy="fsdp")
    seen = {"sharded": type(model[0].weight).__name__ == "DTensor"}
    for use, call in (("forward", lambda: model(x)),
                      ("save", lambda: trainer.save_checkpoint(os.path.join(out_dir, "refused"), model=model))):
        try:
            call()
            seen[use] = None
        except ValueError as e:
            seen[use] = str(e)
    trainer.load_checkpoint(directory, model=model)
    seen["loaded_equal"] = bool(torch.equal(model(x), want))
    return seen


def exit_while_the_agreement_is_in_flight(out_dir):
    """Rank 0 steps 3 s after rank 1, so rank 1 reaches its exit while the SIGTERM agreement's all-reduce it
    started at that step still waits for rank 0. Left to end during finalization, gloo's thread freed its tensor
    there and aborted the process ("terminate called without an active exception"). An atexit handler
    registered before the trainer's (so it runs after it) writes what the trainer left: the all-reduce ended and
    dropped, and whether rank 0 had reached its step by then (a file it writes just before: an order, not a
    clock)."""
    import atexit
    import json
    import time

    stepping = os.path.join(out_dir, "rank0_stepping")

    def at_exit():
        with open(os.path.join(out_dir, f"exit{dist.get_rank() if dist.is_initialized() else rank}.json"), "w") as f:
            left = {"pending": st._STATE.preemption.pending is not None, "peer_stepped": os.path.exists(stepping)}
            json.dump(left, f)

    rank = dist.get_rank()
    atexit.register(at_exit)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    st.SeamlessTPUTrainer(model, device="cpu")
    model(torch.ones(2, 4)).sum().backward()
    if rank == 0:
        time.sleep(3)
        open(stepping, "w").close()
    optimizer.step()
    return {"in_flight": st._STATE.preemption.pending is not None}


class SlowStore(dist.Store):
    """A FileStore whose first read after each write waits 1 s: in each new gloo group, the process holding it
    publishes its address, then is the last to connect, while the others read that address and connect to it."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.wrote = inner, False

    def set(self, key, value):
        self.wrote = True
        return self.inner.set(key, value)

    def get(self, key):
        if self.wrote:
            self.wrote = False
            time.sleep(1)
        return self.inner.get(key)


for _name in ("add", "wait", "check", "compare_set", "delete_key", "num_keys", "set_timeout"):  # the FileStore's
    setattr(SlowStore, _name, lambda self, *args, _name=_name: getattr(self.inner, _name)(*args))


def peers_end_first(out_dir):
    """Rank 0 (its store a SlowStore) is still making its trainer's SIGTERM agreement group when the other ranks
    end theirs, as processes that end right after making their trainer (no collective since) do: 4 groups in a
    row, each from a trainer of its own. gloo connects each pair in the background: a peer whose pairs were all
    connected went on and ended, and rank 0's pair with it failed ("Connection closed by peer")."""
    for _ in range(4):
        st.SeamlessTPUTrainer(torch.nn.Linear(1, 1), device="cpu")
        if dist.get_rank() != 0:
            dist.destroy_process_group(st._STATE.preemption.group)
        st._reset_caches()
    return {"groups": 4}


if __name__ == "__main__":
    case, rank, world, store, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.FileStore(store, world)
    store = SlowStore(store) if case == "peers_end_first" and rank == 0 else store
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        child.report(globals()[case](out_dir))
    finally:
        dist.destroy_process_group()
