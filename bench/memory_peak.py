"""Each device's peak under fsdp (bench section `memory`), on 4 XLA devices, from XLA's own buffer assignment:

    python bench/memory_peak.py MODE WORKLOAD DEPTH [WIDTH]

WORKLOAD: mlp    DEPTH residual blocks x + W2 gelu(W1 x), W1 (4 WIDTH, WIDTH) (WIDTH 1024 unless given), a batch of
                 16, mean squared error; SGD
          qwen3  a Qwen3 causal LM of DEPTH layers, hidden 512 (intermediate 1536, 8 heads, 4 KV heads), built from its
                 config with random weights, 8 x 128 tokens, cross entropy; SGD
          qwen3-remat  the same with gradient_checkpointing_enable(): each layer's activations remade in the backward
          qwen3-small  the same without checkpointing on 4 x 64 tokens, a sequence per device: a quarter of the
                 activations, so that the parameters' and gradients' bytes show
          flat   a Sequential of DEPTH (Linear(WIDTH, WIDTH), LayerNorm) pairs, no block repeated, so unrolled; its
                 largest module, a Linear, stands for a block; a batch of 16, mean squared error; SGD
          cnn    the same with (Conv2d(WIDTH, WIDTH, 3, padding=1), ReLU) pairs on 16 images of 8 x 8 pixels
MODE: shim  the plain loop through SeamlessTPUTrainer(model, strategy="fsdp")
      unrolled  the same with scan=False: repeated blocks run one by one, each product gathering its weight in order
      hand  torch_xla by hand: every parameter split on dim 0 over the 4 devices (FSDPv2's spec), the batch split,
            one torch_xla.sync() a step
Prints one line RESULT {"model_bytes", "block_bytes" (one repeated block's parameters), "peak_bytes" (the largest
'Total bytes used' of the step's programs: one device's buffers, the partitioned program's), "programs" (each
program's name and bytes), "loss"} after 3 steps. SGD without momentum keeps no state, so the ideal peak is the
parameters' and the gradients' shards: 0.5x the model on 4 devices.
"""

import glob
import json
import os
import re
import sys
import tempfile

import torch
import torch.nn.functional as F

import hlo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
DUMP = os.environ.get("MEMORY_DUMP") or tempfile.mkdtemp(prefix="seamless_tpu_memory_")
# hlo.py's flags: the buffer assignment, and the programs around SPMD partitioning (a device's share of the FLOPs)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {hlo.DUMP_FLAGS.format(DUMP)}".strip()


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def workload(name, depth, width, mode):
    """(model, its repeated blocks, batch, loss of (model, batch))"""
    torch.manual_seed(0)
    if name == "flat":  # no repeated blocks: it stays unrolled
        model = torch.nn.Sequential(*(m for _ in range(depth) for m in (torch.nn.Linear(width, width),
                                                                        torch.nn.LayerNorm(width))))
        x, y = torch.randn(16, width), torch.randn(16, width)
        return model, [model[0]], (x, y), lambda m, x, y: F.mse_loss(m(x), y)
    if name == "cnn":  # unrolled as flat is: no module repeated back to back
        model = torch.nn.Sequential(*(m for _ in range(depth) for m in (torch.nn.Conv2d(width, width, 3, padding=1),
                                                                        torch.nn.ReLU())))
        x, y = torch.randn(16, width, 8, 8), torch.randn(16, width, 8, 8)
        return model, [model[0]], (x, y), lambda m, x, y: F.mse_loss(m(x), y)
    if name == "mlp":
        model = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
        x, y = torch.randn(16, width), torch.randn(16, width)
        return model, list(model), (x, y), lambda m, x, y: F.mse_loss(m(x), y)
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=depth, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=128, attn_implementation="sdpa", use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if name == "qwen3-remat":  # by hand through torch_xla's checkpoint: torch's raises on XLA (no torch.xla module)
        model.gradient_checkpointing_enable()
        if mode == "hand":
            import torch_xla.utils.checkpoint

            model._set_gradient_checkpointing(True, torch_xla.utils.checkpoint.checkpoint)
    shape = (4, 64) if name == "qwen3-small" else (8, 128)
    ids = torch.randint(1024, shape, generator=torch.Generator().manual_seed(1))
    return model, list(model.model.layers), (ids, ids), lambda m, x, y: m(input_ids=x, labels=y).loss


def peaks(dump):
    """{program: bytes} of every program compiled: 'Total bytes used' of its buffer assignment (one device's)."""
    out = {}
    for path in glob.glob(os.path.join(dump, "*buffer-assignment.txt")):
        with open(path) as f:
            found = re.search(r"Total bytes used: (\d+)", f.read())
        if found:
            out[os.path.basename(path).split(".cpu_after")[0]] = int(found[1])
    return out


def main(mode, name, depth, width=1024):
    model, blocks, batch, loss_of = workload(name, int(depth), int(width), mode)
    nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    model_bytes, block_bytes = nbytes(model.parameters()), nbytes(blocks[0].parameters())
    import torch_xla

    if mode in ("shim", "unrolled"):
        import seamless_tpu as st

        trainer = st.SeamlessTPUTrainer(model, strategy="fsdp", scan=mode == "shim")
        x, y = trainer.to_device(*batch)
        end_step = lambda: None  # noqa: E731  the trainer cuts the graphs
    else:
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        n = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
        model.to(torch_xla.device())
        for p in model.parameters():
            xs.mark_sharding(p, mesh, ("fsdp",) + (None,) * (p.dim() - 1))
        x, y = (t.to(torch_xla.device()) for t in batch)
        for t in (x, y):
            xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))
        end_step = torch_xla.sync
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        end_step()
    programs = peaks(DUMP)
    print("RESULT " + json.dumps({"model_bytes": model_bytes, "block_bytes": block_bytes,
                                  "peak_bytes": max(programs.values()), "programs": programs,
                                  "loss": float(loss.detach().cpu())}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
