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


if __name__ == "__main__":
    case, rank, world, store, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        print(json.dumps(globals()[case](out_dir)), flush=True)
    finally:
        dist.destroy_process_group()
