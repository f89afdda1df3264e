"""What load_checkpoint costs a process: bytes read, peak host memory, files written.

    python tests/load_cost.py LAYOUT save DIR    # an MLP of 16 x 1152^2 (85 MB) + AdamW: a 255 MB checkpoint
    python tests/load_cost.py LAYOUT warm DIR    # load into a trainer whose optimizer already has state
    python tests/load_cost.py LAYOUT fresh DIR   # load into a new model and an optimizer without state

LAYOUT is fsdp4 (real torch_xla SPMD on 4 virtual CPU devices), ddp4 (the same, saved replicated by
strategy="ddp" and loaded into fsdp shards: 4 shards overlap each stored tensor) or gloo2 (one of 2 gloo
ranks running FSDP2: the caller starts both). A load reports (child.report) the checkpoint's bytes on disk, this
process's bytes read and written (/proc/self/io), its resident memory before, at its peak during and
after the load (VmHWM, reset just before), and whether the weights equal the saved ones bitwise.
"""

import os
import re
import sys

import torch

import child
import seamless_tpu as st

LAYOUT, PHASE, DIRECTORY = sys.argv[1:4]


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(1152, 1152) for _ in range(16)])


def step(net, optimizer, trainer):
    x = trainer.to_device(torch.randn(8, 1152, generator=torch.Generator().manual_seed(0)))
    optimizer.zero_grad()
    net(x).square().mean().backward()
    optimizer.step()


def io(field):
    return int(re.search(rf"{field}: (\d+)", open("/proc/self/io").read()).group(1))


def main():
    if LAYOUT == "gloo2":
        torch.distributed.init_process_group("gloo")
    net = model(0 if PHASE == "save" else 1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    strategy = "ddp" if LAYOUT == "ddp4" and PHASE == "save" else "fsdp"
    trainer = st.SeamlessTPUTrainer(net, device="cpu" if LAYOUT == "gloo2" else "xla", strategy=strategy)
    if PHASE != "fresh":
        step(net, optimizer, trainer)
    if PHASE == "save":
        trainer.save_checkpoint(DIRECTORY, model=net, optimizer=optimizer)
        child.report({})
        return
    importlib_warm = ["torch.distributed.checkpoint", "torch.distributed.checkpoint._traverse"]
    if LAYOUT != "gloo2":  # the module files a first load imports are not the checkpoint's bytes
        importlib_warm.append("torch_xla.experimental.distributed_checkpoint")
    for name in importlib_warm:
        __import__(name)
    st._sync_if_xla()
    before = {"rss": child.kib("VmRSS"), "read": io("rchar"), "written": io("wchar")}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the current resident size
    trainer.load_checkpoint(DIRECTORY, model=net, optimizer=optimizer)
    st._sync_if_xla()
    report = {
        "checkpoint": sum(
            e.stat().st_size for e in os.scandir(st._committed_attempt(DIRECTORY)) if e.name.endswith(".distcp")
        ),
        "read": io("rchar") - before["read"],
        "written": io("wchar") - before["written"],
        "rss_before": before["rss"],
        "rss_peak": child.kib("VmHWM"),
        "rss_after": child.kib("VmRSS"),
    }
    saved = st.consolidate_checkpoint(DIRECTORY)
    report["bitwise"] = all(
        torch.equal(getattr(v, "full_tensor", lambda: v)().cpu(), saved["model"][k])
        for k, v in net.state_dict().items()
    )
    report["adam_bitwise"] = all(
        torch.equal(getattr(v, "full_tensor", lambda: v)().cpu(), saved["optimizer"]["state"][i][k])
        for i, p in enumerate(net.parameters())
        for k, v in optimizer.state[p].items()
        if k != "step"
    )
    child.report(report)


if __name__ == "__main__":
    main()
