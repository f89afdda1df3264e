"""A model built under torch.device("meta") and given to SeamlessTPUTrainer(model, strategy="fsdp").

    python tests/meta_init.py cpu DIR     # build on the CPU (seed 0), save a checkpoint; print each tensor's digest
    python tests/meta_init.py meta DIR    # build on meta (seed 0), trainer, one forward; digests and memory
    python tests/meta_init.py load DIR    # build on meta, trainer, load DIR's checkpoint (no compile); never
                                          # initialised
    python tests/meta_init.py forward DIR STRATEGY [KIND]  # build on meta, trainer(strategy=STRATEGY), one no_grad
                                          # forward of the whole model (every kernel it reaches); digests and memory
    KIND (after STRATEGY, for cpu too): blocks (the default, below) or flat, issue 48's 403 MB Sequential of 24
    (Linear(2048, 2048), LayerNorm) pairs

The model: an embedding, 6 pre-norm blocks (LayerNorm, MultiheadAttention, a 4x MLP) at width 1024 and
a head: 309 MB of float32, 50 MB in each block. Run 'cpu' with SEAMLESS_TPU_DEVICE=cpu and the others on
4 XLA devices. It reports (child.report) digests (sha1 of each tensor's bytes), the process's resident memory before
the first forward or the load (the trainer made, the XLA runtime up), at its peak and after them (VmHWM,
reset just before). On XLA:CPU the devices' memory is the process's too: the model's shards (ddp: its 4 replicas) count.
"""

import hashlib
import sys

import torch

import child
import seamless_tpu as st

WIDTH, BLOCKS = 1024, 6


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, 8, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0] + self.mlp(h)


def build(kind="blocks"):
    torch.manual_seed(0)
    if kind == "flat":  # issue 48's, 403 MB: no repeated block, so no loop
        pairs = ((torch.nn.Linear(2048, 2048), torch.nn.LayerNorm(2048)) for _ in range(24))
        return torch.nn.Sequential(*(m for pair in pairs for m in pair))
    return torch.nn.Sequential(
        torch.nn.Embedding(4096, WIDTH), *[Block(WIDTH) for _ in range(BLOCKS)], torch.nn.Linear(WIDTH, 256)
    )


def digests(model):
    return {k: hashlib.sha1(v.detach().cpu().numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()}


def main(phase, directory, strategy="fsdp", kind="blocks"):
    report = {}
    if phase == "cpu":
        model = build(kind)
        trainer = st.SeamlessTPUTrainer(model, device="cpu")
        trainer.save_checkpoint(directory, model=model, epoch=1)
    else:
        with torch.device("meta"):
            model = build(kind)
        resets = []
        for cls in (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm):
            cls.reset_parameters = (lambda f: lambda self: (resets.append(type(self).__name__), f(self))[1])(
                cls.reset_parameters
            )
        trainer = st.SeamlessTPUTrainer(model, strategy=strategy)  # on XLA: lays the model out, computes nothing
        report["rss_before"] = child.kib("VmRSS")  # the XLA runtime is up
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        out = None  # the whole model's forward output, kept so that the sync below runs its graph
        if phase == "meta":  # the head alone first: any module's first forward initialises the whole model
            model[-1](trainer.to_device(torch.zeros(4, WIDTH)))
        elif phase == "forward":
            batch = torch.zeros(4, 2048) if kind == "flat" else torch.zeros(4, 8, dtype=torch.long)
            with torch.no_grad():
                out = model(trainer.to_device(batch))
        else:
            import torch_xla.debug.metrics as met

            compiles = met.counter_value("UncachedCompile") or 0
            report["epoch"] = trainer.load_checkpoint(directory, model=model)["epoch"]
            report["load_compiles"], report["rss_load_peak"] = (
                (met.counter_value("UncachedCompile") or 0) - compiles,
                child.kib("VmHWM"),
            )
            model(trainer.to_device(torch.zeros(4, 8, dtype=torch.long)))
        st._sync_if_xla()
        report.update(rss_peak=child.kib("VmHWM"), rss_after=child.kib("VmRSS"), resets=len(resets))
        report["output"] = None if out is None else list(out.shape)
        import torch_xla

        report["sharded"] = all(
            torch_xla._XLAC._get_xla_sharding_spec(p).startswith("{devices=[") for p in model.parameters()
        )
        report["replicas"] = 4 if strategy == "ddp" else 1  # copies of the model the devices hold, in this process
    report["bytes"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    sizes = sorted((sum(t.numel() * t.element_size() for t in m.parameters(recurse=False)) for m in model.modules()),
                   reverse=True)
    report["largest_module"], report["largest_4_modules"] = sizes[0], sum(sizes[:4])
    report["digests"] = digests(model)
    child.report(report)


if __name__ == "__main__":
    main(*sys.argv[1:5])
