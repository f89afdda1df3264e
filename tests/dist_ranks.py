"""One rank of a 2-process gloo world on CPU, for the fast tier (test_seamless_tpu.py runs two).

    python tests/dist_ranks.py CASE RANK WORLD_SIZE STORE_FILE OUT_DIR

Prints one JSON line: what this rank saw.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

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


if __name__ == "__main__":
    case, rank, world, store, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        print(json.dumps(globals()[case](out_dir)), flush=True)
    finally:
        dist.destroy_process_group()
