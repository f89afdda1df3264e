"""The worker side: what one benchmark worker process (bench/bench.py --worker NAME --workload W) sets up and
steps: the workloads (build), the torch_xla SPMD set-up people write by hand, Variant (one way of writing the loop)
and profile (per-device bytes and the step's collectives, after the timed rounds). bench.py's serve() answers the
driver's commands with them."""

import glob
import os

import hlo  # bench/hlo.py: what XLA compiled; the tests read dot FLOPs with it too
from harness import THREADS, TP_VARIANTS

LOG_VARIANTS = ("shim_log", "shim_item")  # the shim's loop plus trainer.log(loss=loss) / loss.item() every step


def build(workload):
    import torch

    torch.manual_seed(0)
    if workload == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

        def loss_fn(m, x, y):
            return torch.nn.functional.cross_entropy(m(x), y)
    elif workload == "lm":  # a transformers Qwen3 from a config (random weights, nothing downloaded), its TP plan
        import transformers

        config = transformers.Qwen3Config(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            max_position_embeddings=256,
            attn_implementation="eager",
            use_cache=False,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
        x = torch.randint(0, 2048, (8, 128))
        y = x.clone()

        def loss_fn(m, x, y):
            return m(input_ids=x, labels=y).loss
    else:
        layer = torch.nn.TransformerEncoderLayer(
            d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0, batch_first=True
        )
        model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        x, y = torch.randn(16, 128, 256), torch.randn(16, 128, 256)

        def loss_fn(m, x, y):
            return torch.nn.functional.mse_loss(m(x), y)
    return model, x, y, loss_fn


def handwritten_xla(model):
    """The torch_xla SPMD set-up people write by hand. Returns put(tensor): on the device, dim 0
    sharded over a 1-D 'data' mesh."""
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    torch.__future__.set_swap_module_params_on_conversion(True)  # keep the optimizer's params
    model.to(device)

    def put(t):
        t = t.to(device)
        xs.mark_sharding(t, mesh, ("data",) + (None,) * (t.dim() - 1))
        return t

    return put


class Variant:
    """Sets up one way of writing the loop; step() runs one optimizer step; wait() drains the device."""

    def __init__(self, name, workload):
        import torch

        torch.set_num_threads(THREADS)
        self.name, self.torch = name, torch
        model, x, y, self.loss_fn = build(workload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.wait, self.metrics = (lambda: None), None
        if name == "plain":
            pass
        elif name in TP_VARIANTS or name in LOG_VARIANTS:
            import seamless_tpu as st

            trainer = st.SeamlessTPUTrainer(model, **TP_VARIANTS.get(name, {}), progress=False)
            x, y = trainer.to_device(x, y)
            self.trainer = trainer
            if st.is_xla_backend():
                self._xla_waits()
        elif name == "handwritten_xla":
            import torch_xla

            put = handwritten_xla(model)
            x, y = put(x), put(y)
            self.sync = torch_xla.sync
            self._xla_waits()
        elif name == "accelerate":
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=True)
            model, optimizer = self.accelerator.prepare(model, optimizer)
        elif name == "fabric":
            from lightning.fabric import Fabric

            self.fabric = Fabric(accelerator="cpu", devices=1)
            model, optimizer = self.fabric.setup(model, optimizer)
        self.model, self.optimizer, self.x, self.y = model, optimizer, x, y

    def _xla_waits(self):
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        self.wait, self.metrics = xm.wait_device_ops, met

    def step(self):
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model, self.x, self.y)
        if self.name == "accelerate":
            self.accelerator.backward(loss)
        elif self.name == "fabric":
            self.fabric.backward(loss)
        else:
            loss.backward()
        self.optimizer.step()
        if self.name == "handwritten_xla":
            self.sync()
        elif self.name == "shim_log":
            self.trainer.log(1, loss=loss)  # read on the log's thread once the step ran
        elif self.name == "shim_item":
            loss.item()  # what trainer.log replaces: the host waits for the step, every step

    def counters(self):
        if self.metrics is None:
            return {}
        transfers = self.metrics.metric_data("TransferFromDeviceTime")
        return {
            "compiles": self.metrics.counter_value("UncachedCompile") or 0,
            "transfers": transfers[0] if transfers else 0,
        }


def profile(variant, dump):
    """Per-device bytes and the step's collectives. Asked after the timed rounds: the optimizer
    state exists, and the last graph compiled is the steady-state step."""
    variant.step()  # a fresh variant gets its optimizer state; a warm one compiles nothing
    shapes = [tuple(p.shape) for p in variant.model.parameters()]
    dots = None
    if dump and glob.glob(os.path.join(dump, "*spmd-partitioning*")):
        dots = hlo.dot_flops_per_device(dump)
    return {
        "bytes": variant.trainer.memory_stats(variant.optimizer),
        "collectives": hlo.step_collectives(dump, shapes) if dump else {},
        "dot_flops": dots,
    }
