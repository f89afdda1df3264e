"""Real workloads through seamless_tpu on real torch_xla SPMD (4 virtual CPU devices), each
checked against the same loop run eagerly on CPU in a separate process.

    python tests/workloads.py NAME            # XLA run; spawns `NAME --eager` first for the reference
    python tests/workloads.py NAME --eager    # the eager reference alone: reports it (child.report)

tests/test_workloads.py runs every name in SCENARIOS with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4
SEAMLESS_TPU_DEVICE=xla. The eager reference must run in its own process: a CPU backward before
XLA starts breaks XLA autograd in that process.

The loops are plain PyTorch (optimizer.step(), no mark_step). A loop takes `trainer`: None is the
eager reference; otherwise it is a SeamlessTPUTrainer, and the loop calls only its public API
(prepare_data_loader, to_device, autocast, compile_stats). Models are built from configs with
random weights: nothing is downloaded.
"""

import contextlib
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (ROOT, HERE) if p not in sys.path]

import child  # noqa: E402
import scenarios  # noqa: E402  (the real tier's helpers)
import seamless_tpu as st  # noqa: E402

XLA_VARS = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "SEAMLESS_TPU_DEVICE", "XLA_FLAGS")

# --- plumbing ------------------------------------------------------------------------------------


def eager_reference(name, script=__file__):
    """Run `script name --eager` in a fresh CPU-only process and return its report. Call it before this
    process touches XLA (it only waits on the child, so one XLA process runs at a time)."""
    start = time.time()
    out = child.run([os.path.abspath(script), name, "--eager"], timeout=300,
                    env=child.env(drop=XLA_VARS, SEAMLESS_TPU_DEVICE="cpu", PYTHONUNBUFFERED="1"))
    print(f"eager reference {name}: {time.time() - start:.1f}s")
    return child.result(out.stdout)


def trainer_for(model, xla, **kwargs):
    return st.SeamlessTPUTrainer(model, **kwargs) if xla else None


def loader_on(trainer, loader):
    return trainer.prepare_data_loader(loader) if trainer else loader


def on_device(trainer, *objs):
    if trainer is None:
        return objs[0] if len(objs) == 1 else objs
    return trainer.to_device(*objs)


def autocast(trainer):
    return trainer.autocast() if trainer else contextlib.nullcontext()


def compiles(trainer):
    return trainer.compile_stats()["compiles"] if trainer else 0


def plain_steps(trainer, model, optimizer, batches, loss_of):
    """The user's loop, one optimizer step per batch: losses stay on the device until the end, and
    the compile count is taken after every step."""
    losses, counts = [], []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        counts.append(compiles(trainer))
    return {"losses": host(losses), "compiles": counts}


def host(losses):
    """Device losses -> floats, once, at the end: no host sync inside the loop."""
    return [float(v) for v in torch.stack([loss.float() for loss in losses]).cpu()]


assert_close = scenarios.assert_close


def assert_flat(counts, after, what):
    """UncachedCompile recorded after every step must stop growing after step `after` (1-based)."""
    print(f"{what}: UncachedCompile after each step {counts}")
    assert counts[after - 1] == counts[-1], f"{what}: compiles grew after step {after}: {counts}"


def quiet():
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


# --- a. tiny causal LM + LoRA ----------------------------------------------------------------------

LM_VOCAB, LM_SEQ, LM_BATCH, LM_MICRO = 128, 16, 4, 2
LORA_RANK = 4


def tiny_lm_config(arch="qwen3", attn="eager"):
    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[arch]
    return cls(vocab_size=LM_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation=attn, use_cache=False)


def tiny_lm(arch="qwen3", attn="eager", seed=0):
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_lm_config(arch, attn))


class TokenBatches(torch.utils.data.Dataset):
    """Dict samples; the last `pad[i]` positions are padding (mask 0, label -100)."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, LM_VOCAB, (n, LM_SEQ), generator=g)
        self.pad = torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = torch.ones(LM_SEQ, dtype=torch.long)
        if self.pad[i]:
            mask[-int(self.pad[i]):] = 0
        labels = self.ids[i].masked_fill(mask == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": labels}


def lm_lora_loop(xla, precision=None, steps=8, lora=True, strategy="ddp", **trainer_kwargs):
    """Gradient accumulation, clipping and a warm-up schedule on a tiny Qwen3: LoRA adapters, or
    (lora=False) every weight, for strategy='fsdp'."""
    import peft
    import transformers

    quiet()
    model = tiny_lm("qwen3")
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=LORA_RANK, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2, weight_decay=0.01)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    trainer = trainer_for(model, xla, precision=precision, strategy=strategy, **trainer_kwargs)
    loader = loader_on(
        trainer, torch.utils.data.DataLoader(TokenBatches(steps * LM_MICRO * LM_BATCH), batch_size=LM_BATCH)
    )
    losses, counts, transfers, dtypes = [], [], [], set()
    optimizer.zero_grad()
    for i, batch in enumerate(loader):
        with autocast(trainer):
            out = model(**batch)
        loss = out.loss / LM_MICRO
        dtypes.add(str(out.logits.dtype))
        loss.backward()
        losses.append(loss.detach())
        if (i + 1) % LM_MICRO == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counts.append(compiles(trainer))
            transfers.append(trainer.compile_stats()["device_to_host_transfers"] if trainer else 0)
    assert len(counts) == steps, f"{len(counts)} optimizer steps, expected {steps}"
    specs = {n: torch_xla_spec(p) for n, p in model.named_parameters() if p.dim() == 2} if trainer else {}
    memory = trainer.memory_stats(optimizer) if trainer else None
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p.detach().cpu(), before[n]))
    return {
        "losses": host(losses),
        "compiles": counts,
        "transfers": transfers,
        "logits_dtypes": sorted(dtypes),
        "specs": specs,
        "bytes_per_device": max(memory["per_device"]) / memory["replica"] if memory else None,
        "changed": changed,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }


def lm_lora_eager():
    return lm_lora_loop(False)


def lm_lora():
    want = eager_reference("lm_lora")
    assert want["losses"][-1] < want["losses"][0], "the reference loop must train"
    got = lm_lora_loop(True)
    assert_close(got["losses"], want["losses"], 1e-5, "LoRA LM fp32 vs eager")
    assert_flat(got["compiles"], 2, "LoRA LM fp32")
    assert got["logits_dtypes"] == ["torch.float32"], got["logits_dtypes"]


def lm_full_eager():
    return lm_lora_loop(False, lora=False)


def lm_fsdp():
    """A transformers causal LM, every weight trained, with strategy='fsdp': eager's losses, each
    weight matrix split over the 4 devices, compiles flat."""
    want = eager_reference("lm_fsdp")  # random tokens leave little to learn: equal losses after 8 updates are the proof
    got = lm_lora_loop(True, lora=False, strategy="fsdp")
    assert_close(got["losses"], want["losses"], 1e-5, "Qwen3 fsdp vs eager")
    assert_flat(got["compiles"], 2, "Qwen3 fsdp")
    assert got["specs"] and all(
        s.startswith("{devices=[") and ("4,1]" in s or "1,4]" in s) for s in got["specs"].values()
    ), got["specs"]


def lm_tp_eager():
    return lm_lora_loop(False, steps=TP_STEPS, lora=False)


TP_STEPS = 20
TP_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lm_tensor_parallel():
    """Qwen3's own plan (config.base_model_tp_plan + the head's) on a 2 x 2 ("fsdp", "model") mesh and a
    1 x 4 ("data", "model") one: eager's losses over 20 AdamW steps, every attention and MLP weight
    split over "model" (and over "fsdp" in 2-D), a quarter of the bytes per device on 2 x 2, compiles
    and host transfers flat after warm-up."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs

    import hlo

    want = eager_reference("lm_tensor_parallel")
    for strategy, config, shape in (
        ("fsdp", {"model_parallel_size": 2}, (2, 2)),
        ("ddp", {"model_parallel_size": 4}, (1, 4)),
    ):
        what = f"Qwen3 tensor parallel, {strategy} {shape}"
        got = lm_lora_loop(True, steps=TP_STEPS, lora=False, strategy=strategy, xla_spmd_config=config)
        if shape == (2, 2):  # dumped from the first graphs XLA compiles in this process (main() set XLA_FLAGS)
            dump = os.environ["SEAMLESS_TPU_HLO_DUMP"]
            whole, one, ratio = hlo.dot_flops_per_device(dump)
            print(f"{what}: dot FLOPs per step {whole} in all, {one} on one device ({ratio:.3f})")
            # attention's products included: the trainer's matmul keeps (batch, heads) apart, where torch's folded
            # them into one dim of which GSPMD kept one split (0.271 before)
            assert ratio == 0.25, f"{what}: a device holds {ratio:.3f} of the step's dot FLOPs, not 1/4"
        assert_close(got["losses"], want["losses"], 1e-5, what)
        assert_flat(got["compiles"], 2, what)
        assert_flat(got["transfers"], 2, what + " host transfers")
        names = ("fsdp" if strategy == "fsdp" else "data", "model")
        mesh = xs.Mesh(np.arange(4), shape, names)
        model = tiny_lm()
        for name, spec in got["specs"].items():
            layer = name.split(".")[-2]
            if layer in TP_LAYERS:
                dim = 0 if layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else 1
                partition = [None, None]
                partition[dim] = "model"
                if strategy == "fsdp":
                    partition[1 - dim] = "fsdp"
                oracle = torch.zeros(model.get_parameter(name).shape, device=torch_xla.device())
                xs.mark_sharding(oracle, mesh, tuple(partition))
                assert spec == torch_xla_spec(oracle), f"{what}: {name} is {spec}, not split as {tuple(partition)}"
        planned = [n for n in got["specs"] if n.split(".")[-2] in TP_LAYERS]
        assert len(planned) == 2 * len(TP_LAYERS), planned
        print(f"{what}: params + AdamW state per device = {got['bytes_per_device']:.3f} of a replica")
        if shape == (2, 2):
            assert got["bytes_per_device"] <= 0.30, got["bytes_per_device"]


def lm_lora_tensor_parallel():
    """peft LoRA (q_proj, v_proj) on Qwen3 with the plan of the model inside the PeftModel, on a 2 x 2
    ("data", "model") mesh: eager's losses, each planned base weight split over "model" as planned (a LoRA
    layer's through its base_layer), lora_B of those colwise layers split as their base, lora_A whole, and
    only the adapters stepped."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs

    want = eager_reference("lm_lora")
    got = lm_lora_loop(True, xla_spmd_config={"model_parallel_size": 2})
    what = "Qwen3 + LoRA tensor parallel, ddp (2, 2)"
    assert_close(got["losses"], want["losses"], 1e-5, what)
    assert_flat(got["compiles"], 2, what)
    assert got["trainable"] == got["changed"] == want["changed"], (got["trainable"], got["changed"])
    assert got["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in got["trainable"]), got["trainable"]
    mesh, inner = xs.Mesh(np.arange(4), (2, 2), ("data", "model")), tiny_lm()
    seen = {}
    for name, spec in got["specs"].items():
        parts = name.split(".")  # ...q_proj.base_layer.weight, ...q_proj.lora_B.default.weight, ...k_proj.weight
        adapter = parts[-3] if parts[-3] in ("lora_A", "lora_B") else None
        layer = parts[-3] if parts[-2] == "base_layer" else parts[-4] if adapter else parts[-2]
        if layer not in TP_LAYERS:
            continue
        colwise = layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        partition = [None, None]
        if adapter != "lora_A":  # lora_A of a colwise layer reads the whole input: left whole
            partition[0 if colwise else 1] = "model"
        base = inner.get_parameter(".".join(p for p in parts[2:] if p != "base_layer") if not adapter else
                                   ".".join(parts[2:-3]) + ".weight")
        shape = {None: base.shape, "lora_A": (LORA_RANK, base.shape[1]), "lora_B": (base.shape[0], LORA_RANK)}[adapter]
        oracle = torch.zeros(tuple(shape), device=torch_xla.device())
        xs.mark_sharding(oracle, mesh, tuple(partition))  # (None, None): '{replicated}', as a trained weight shows
        assert spec == torch_xla_spec(oracle), f"{what}: {name} is {spec!r}, not split as {tuple(partition)}"
        seen[name] = spec
    q_proj = {n.split("q_proj.")[1]: s for n, s in seen.items() if ".0.self_attn.q_proj." in n}
    print(f"{what}: {len(seen)} weights checked; layer 0's q_proj: {q_proj}")
    assert sum(".base_layer." in n for n in seen) == 4 and sum(".lora_B." in n for n in seen) == 4, sorted(seen)
    assert len(seen) == 2 * len(TP_LAYERS) + 8, sorted(seen)  # 7 planned layers x 2, and A and B of 4 LoRA layers


def lm_lora_bf16():
    """precision='bf16' against the fp32 losses (eager's, which lm_lora shows equal XLA's to 1e-5)."""
    fp32 = eager_reference("lm_lora")
    bf16 = lm_lora_loop(True, precision="bf16")
    assert bf16["logits_dtypes"] == ["torch.bfloat16"], f"autocast did not reach the model: {bf16['logits_dtypes']}"
    rel = max(abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"]))
    print(f"LoRA LM bf16 vs fp32: max relative diff {rel:.3g}")
    assert rel < 2e-2, f"bf16 vs fp32 relative diff {rel:.3g}"
    assert_flat(bf16["compiles"], 2, "LoRA LM bf16")


# --- b. torchvision resnet18 + BatchNorm ---------------------------------------------------------


def bn_running_var(trainer, aten=False):
    """One train-mode forward of BatchNorm1d(3) on 4 samples; running_var after it. aten: through
    aten::native_batch_norm, torch_xla's own kernel (the trainer's kernel for XLA tensors is on aten::batch_norm,
    above it, which the module, F.batch_norm and torch.batch_norm all reach)."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(4, 3)
    if trainer is not None:
        bn = bn.to(trainer.device)
        x = trainer.to_device(x)
    bn.train()
    if aten:
        torch.ops.aten.native_batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5)
    else:
        bn(x)
    return bn.running_var.cpu().tolist()


def resnet_loop(xla, steps=4):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    # XLA's conv gradients differ from eager's by up to ~3e-4 relative at step 1 (plain XLA without
    # SPMD too: XLA CPU numerics, not the shim), and resnet18 with 4-sample BatchNorm and random
    # labels amplifies that chaotically: at lr=1e-2 the step-3 loss differed by 0.1, at lr=1e-4 the
    # step-5 loss by 6e-3. Hence a tiny lr and 4 steps (measured max |diff| ~6e-5).
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    trainer = trainer_for(model, xla)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(steps)]
    model.train()
    moved = (on_device(trainer, x, y) for x, y in batches)  # one batch at a time, inside the loop
    result = plain_steps(trainer, model, optimizer, moved, lambda m, xy: F.cross_entropy(m(xy[0]), xy[1]))
    return {
        **result,
        "bn_running_var": bn_running_var(trainer),
        "bn_running_var_aten": bn_running_var(trainer, aten=True) if xla else None,
        "bn1_running_var": model.bn1.running_var.cpu().tolist(),
    }


def resnet_eager():
    return resnet_loop(False)


def resnet_handwritten(steps=4):
    """The same loop written by hand for torch_xla SPMD, as the shim runs it: the model replicated,
    each batch split over a 1-D ("data",) mesh of every device, one sync after each step."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    device = torch_xla.device()
    model.to(device)
    n = torch_xla.runtime.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(steps)]
    model.train()
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        xs.mark_sharding(x, mesh, ("data", None, None, None))
        xs.mark_sharding(y, mesh, ("data",))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.detach())
    return {"losses": host(losses), "bn1_running_var": model.bn1.running_var.cpu().tolist()}


# XLA:CPU convolution gradients differ from eager's, and resnet18 with 4-sample BatchNorm amplifies
# that, so "shim vs eager" mixes the shim with XLA's own numerics. The test asks two questions.
# (1) Is the shim the hand-written torch_xla loop, within XLA's numerics? It was bitwise equal over 11 runs
# until the shim marked each block's output batch-split (issue 27; the hand-written loop, run in this process
# after the trainer, shares its replaced F.batch_norm but marks the input only): the partitioned programs now
# differ and reduce in another order (9.5e-5 in 4 steps). (2) Is XLA
# within its measured spread of eager? The 4-step loss difference is
# repeatable on one machine and configuration (1.08e-4 in 11 runs, 1 or 2 cores) but moves with XLA's
# CPU code generation: 2.81e-4 with --xla_cpu_multi_thread_eigen=false, 1.83e-4 and ~6e-5 on other
# machines. The bound is 3x the worst of those (README, "Tolerances").
RESNET_VS_HANDWRITTEN = 3e-4  # 3x the 9.5e-5 measured
RESNET_VS_EAGER = 1e-3


def resnet18_bn():
    want = eager_reference("resnet18_bn")
    got = resnet_loop(True)
    by_hand = resnet_handwritten()
    assert_close(got["losses"], by_hand["losses"], RESNET_VS_HANDWRITTEN, "resnet18 shim vs hand-written torch_xla")
    assert_close(got["bn1_running_var"], by_hand["bn1_running_var"], RESNET_VS_HANDWRITTEN,
                 "resnet18 bn1.running_var shim vs hand-written torch_xla")
    assert_close(got["losses"], want["losses"], RESNET_VS_EAGER, "resnet18 vs eager")
    assert_flat(got["compiles"], 2, "resnet18")
    # Pin torch_xla 2.9's BatchNorm (aten::native_batch_norm, which the trainer's batch_norm does not call in
    # training): running_var takes the biased batch variance (divide by n), eager the unbiased one (n - 1), as
    # does the trainer. When this fails, torch_xla changed: update this pin.
    torch.manual_seed(0)
    torch.nn.BatchNorm1d(3)  # same RNG use as bn_running_var
    x = torch.randn(4, 3)
    biased = (0.9 + 0.1 * x.var(0, unbiased=False)).tolist()
    unbiased = (0.9 + 0.1 * x.var(0, unbiased=True)).tolist()
    print(f"BatchNorm1d(3) running_var after one step: xla {got['bn_running_var']} eager {want['bn_running_var']}")
    assert_close(want["bn_running_var"], unbiased, 1e-6, "eager running_var = unbiased")
    assert_close(got["bn_running_var_aten"], biased, 1e-6, "xla running_var = biased (torch_xla 2.9)")
    assert_close(got["bn_running_var"], unbiased, 1e-6, "the trainer's running_var = eager's, unbiased")
    # resnet18's bn1 counts 4 x 16 x 16 values per channel, so biased and unbiased variance differ by
    # 1/1024 relative, and running_var follows: measured 3.5e-5 in every configuration above.
    assert_close(got["bn1_running_var"], want["bn1_running_var"], 3e-4, "resnet18 bn1.running_var vs eager")


# --- c. two optimizers + eval pass (tiny GAN) ----------------------------------------------------

GAN_EPOCHS, GAN_STEPS, GAN_BATCH, GAN_Z = 4, 4, 8, 8


def gan_loop(xla):
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(GAN_Z, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    disc = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2, betas=(0.5, 0.999))
    trainer = trainer_for(gen, xla)
    if trainer:
        disc.to(trainer.device)
    g = torch.Generator().manual_seed(1)
    centre = torch.tensor([2.0, -1.0])
    batches = [(centre + 0.3 * torch.randn(GAN_BATCH, 2, generator=g), torch.randn(GAN_BATCH, GAN_Z, generator=g))
               for _ in range(GAN_STEPS)]
    eval_z = torch.randn(16, GAN_Z, generator=g)
    ones, zeros = torch.ones(GAN_BATCH, 1), torch.zeros(GAN_BATCH, 1)
    ones, zeros, eval_z = on_device(trainer, ones, zeros, eval_z)
    d_losses, g_losses, evals, counts = [], [], [], []
    for _ in range(GAN_EPOCHS):
        gen.train(), disc.train()
        for real, z in batches:
            real, z = on_device(trainer, real, z)
            opt_d.zero_grad()
            fake = gen(z).detach()
            d_loss = F.binary_cross_entropy_with_logits(disc(real), ones) + F.binary_cross_entropy_with_logits(
                disc(fake), zeros
            )
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = F.binary_cross_entropy_with_logits(disc(gen(z)), ones)
            g_loss.backward()
            opt_g.step()
            d_losses.append(d_loss.detach())
            g_losses.append(g_loss.detach())
        gen.eval(), disc.eval()
        with torch.no_grad():
            samples = gen(eval_z)
            evals.append(
                torch.stack(
                    [(samples - centre.to(samples.device)).pow(2).sum(1).mean(), torch.sigmoid(disc(samples)).mean()]
                )
            )
        counts.append(compiles(trainer))
    flat_evals = torch.stack(evals).flatten()
    return {"d_losses": host(d_losses), "g_losses": host(g_losses), "evals": host(list(flat_evals)), "compiles": counts}


def gan_eager():
    return gan_loop(False)


def gan_two_optimizers():
    want = eager_reference("gan_two_optimizers")
    with scenarios.Warnings() as caught:
        got = gan_loop(True)
    # The eval forward stays pending and compiles into the next step's graph once: a stable loop,
    # which the watchdog must not warn about.
    assert not caught.recompiles, caught.messages
    assert_close(got["d_losses"], want["d_losses"], 1e-5, "GAN discriminator losses vs eager")
    assert_close(got["g_losses"], want["g_losses"], 1e-5, "GAN generator losses vs eager")
    assert_close(got["evals"], want["evals"], 1e-5, "GAN eval metrics vs eager")
    # Per epoch, not per step: the lazy eval graph joins the next epoch's first step, so epoch 2
    # compiles that combined graph once; from then on nothing new may compile.
    assert_flat(got["compiles"], 2, "GAN (per epoch)")


# --- d. activation checkpointing -----------------------------------------------------------------


class CheckpointedMLP(torch.nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = torch.nn.Linear(16, 32)  # not checkpointed: the blocks' input then requires grad
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)) for _ in range(3)])
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.out(h)


def checkpoint_mlp_loop(xla, use_reentrant, steps=6):
    torch.manual_seed(0)
    model = CheckpointedMLP(use_reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = trainer_for(model, xla)
    g = torch.Generator().manual_seed(1)
    x, y = on_device(trainer, torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
    return plain_steps(trainer, model, optimizer, [(x, y)] * steps, lambda m, xy: F.mse_loss(m(xy[0]), xy[1]))


def checkpoint_torch_utils_eager():
    return {str(r): checkpoint_mlp_loop(False, r) for r in (True, False)}


def checkpoint_torch_utils():
    want = eager_reference("checkpoint_torch_utils")
    for reentrant in (True, False):
        got = checkpoint_mlp_loop(True, reentrant)
        assert_close(
            got["losses"], want[str(reentrant)]["losses"], 1e-5, f"torch.utils.checkpoint use_reentrant={reentrant}"
        )
        assert_flat(got["compiles"], 2, f"torch.utils.checkpoint use_reentrant={reentrant}")


def hf_checkpoint_loop(xla, use_reentrant, steps=5):
    quiet()
    model = tiny_lm("llama")
    model.train()
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = trainer_for(model, xla)
    loader = loader_on(
        trainer, torch.utils.data.DataLoader(TokenBatches(LM_BATCH * steps, seed=2), batch_size=LM_BATCH)
    )
    return plain_steps(trainer, model, optimizer, loader, lambda m, batch: m(**batch).loss)


def checkpoint_hf_eager():
    return {str(r): hf_checkpoint_loop(False, r) for r in (None, True)}


def checkpoint_hf():
    want = eager_reference("checkpoint_hf")
    for reentrant in (None, True):  # None: transformers' default (use_reentrant=False in 5.x)
        got = hf_checkpoint_loop(True, reentrant)
        what = f"HF gradient_checkpointing_enable(use_reentrant={reentrant})"
        assert_close(got["losses"], want[str(reentrant)]["losses"], 1e-5, what)
        assert_flat(got["compiles"], 2, what)


# --- e. pins for torch_xla / transformers behaviours ---------------------------------------------


def hf_save_pretrained_pin():
    """save_pretrained() cannot read XLA storages; a CPU state_dict round-trips exactly."""
    import transformers

    quiet()
    model = tiny_lm("llama")
    trainer = st.SeamlessTPUTrainer(model)
    assert next(model.parameters()).device.type == "xla"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model.save_pretrained(os.path.join(tmp, "on_xla"))
        except RuntimeError as e:
            assert "invalid python storage" in str(e), str(e)
            print(f"save_pretrained on XLA tensors: RuntimeError: {e}")
        else:
            raise AssertionError(
                "save_pretrained on XLA tensors worked: torch_xla/safetensors changed, update this pin"
            )
        on_cpu = {k: v.cpu() for k, v in model.state_dict().items()}
        # save_pretrained empties the state_dict it is given (transformers 5.x): pass a copy.
        given = dict(on_cpu)
        model.save_pretrained(os.path.join(tmp, "cpu_copy"), state_dict=given)
        print(f"save_pretrained(state_dict=...) left {len(given)} of {len(on_cpu)} keys in the dict it was given")
        back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "cpu_copy")).state_dict()
        assert set(back) == set(on_cpu), set(back) ^ set(on_cpu)
        wrong = [k for k in on_cpu if not torch.equal(back[k], on_cpu[k])]
        assert not wrong, f"round trip changed {wrong}"
        # trainer.save() is the library's own route: a torch.save of CPU tensors.
        path = trainer.save(model, os.path.join(tmp, "model.pt"))
        saved = torch.load(path, map_location="cpu")
        assert all(torch.equal(saved[k], on_cpu[k]) for k in on_cpu)
    print(f"save_pretrained(state_dict=<cpu copy>) round-trips {len(on_cpu)} tensors exactly")


def hf_attention_transfers_pin():
    """Device->host transfers per forward: sdpa checks its causal mask on the host; eager does
    not when an attention_mask is given (without one, packed-sequence detection reads it)."""
    met = __import__("torch_xla.debug.metrics", fromlist=["_"])
    quiet()
    counts = {}
    for attn in ("sdpa", "eager"):
        model = tiny_lm("llama", attn)
        trainer = st.SeamlessTPUTrainer(model)
        ids, mask = trainer.to_device(TokenBatches(LM_BATCH).ids, torch.ones(LM_BATCH, LM_SEQ, dtype=torch.long))
        for name, kwargs in (
            ("with_mask", {"input_ids": ids, "attention_mask": mask}),
            ("no_mask", {"input_ids": ids}),
        ):
            per_forward = []
            for _ in range(2):
                before = trainer.compile_stats()["device_to_host_transfers"]
                model(**kwargs, labels=ids)
                per_forward.append(trainer.compile_stats()["device_to_host_transfers"] - before)
                __import__("torch_xla").sync()
            counts[f"{attn}/{name}"] = per_forward
    print(f"device->host transfers per forward: {counts}")
    assert met.metric_data("TransferFromDeviceTime") is not None
    assert min(counts["sdpa/with_mask"]) > 0 and min(counts["sdpa/no_mask"]) > 0, counts
    assert counts["eager/with_mask"] == [0, 0], counts
    assert min(counts["eager/no_mask"]) > 0, counts  # packed-sequence detection (transformers 5.x)


MISTRAL_WINDOWS = (4, 4096)  # below the 16 positions, and Mistral's default above them: its cache slices [-4095:]


def mistral_loop(xla, window, steps=2):
    """A tiny MistralForCausalLM from its config with `sliding_window` = window and use_cache at its default (True:
    in training too each layer's DynamicSlidingWindowLayer keeps keys[:, :, -window + 1:]), `steps` AdamW steps, the
    layers unrolled (scan=False)."""
    import transformers

    quiet()
    config = transformers.MistralConfig(
        vocab_size=LM_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=window,
        attn_implementation="eager")
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = trainer_for(model, xla, scan=False)
    loader = loader_on(trainer, torch.utils.data.DataLoader(TokenBatches(steps * LM_BATCH), batch_size=LM_BATCH))
    return plain_steps(trainer, model, optimizer, loader, lambda m, b: m(**b).loss)


def mistral_sliding_window_eager():
    return {str(window): mistral_loop(False, window)["losses"] for window in MISTRAL_WINDOWS}


def mistral_sliding_window():
    """transformers' sliding-window cache slices its keys [-window + 1:], before the start of fewer positions, which
    torch_xla 2.9 refused ("Value out of range (expected to be in range of [-16, 15], but got -4095)"): Mistral,
    Gemma2 and Gemma3 crashed in training with their default config (issue 61). Through the trainer, a window below
    and above the sequence: eager's losses."""
    want = eager_reference("mistral_sliding_window")
    assert want["4"][0] != want["4096"][0], "the window is in the mask: 4 of 16 positions change the loss"
    for window in MISTRAL_WINDOWS:
        got = mistral_loop(True, window)
        assert_close(got["losses"], want[str(window)], 1e-5, f"Mistral, sliding_window={window}, vs eager")
        print(f"Mistral, sliding_window={window}: losses {got['losses']}, eager's {want[str(window)]}")


# --- entry point ---------------------------------------------------------------------------------

def tiny_tokenizer():
    """A word-level tokenizer built in code (nothing downloaded), as transformers' own tests build one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(LM_VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


class Texts(torch.utils.data.Dataset):
    def __init__(self, tokenizer, n=8):
        self.features = [tokenizer(" ".join(f"w{(i * 7 + j) % 100}" for j in range(3 + i % 4))) for i in range(n)]

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return self.features[i]


def hf_batches_are_sharded():
    """transformers' BatchEncoding (tokenizer output, DataCollatorWithPadding, DataCollatorForLanguageModeling)
    arrives split over the 4 devices on every path, a BatchEncoding still, its encodings kept; a step of
    the tiny LM on it compiles and runs."""
    from transformers import BatchEncoding, DataCollatorForLanguageModeling, DataCollatorWithPadding

    quiet()
    tokenizer = tiny_tokenizer()
    model = tiny_lm()
    trainer = st.SeamlessTPUTrainer(model)
    texts = ["w1 w2 w3 w4", "w5 w6", "w7 w8 w9", "w10"]
    batches = {"to_device(tokenizer output)": st.to_device(tokenizer(texts, padding=True, return_tensors="pt")),
               "trainer.to_device(tokenizer "
               "output)": trainer.to_device(tokenizer(texts, padding=True, return_tensors="pt"))}
    for name, collator in (("DataCollatorWithPadding", DataCollatorWithPadding(tokenizer)),
                           ("DataCollatorForLanguageModeling", DataCollatorForLanguageModeling(tokenizer, mlm=False))):
        for workers in (0, 2):
            loader = torch.utils.data.DataLoader(
                Texts(tokenizer), batch_size=4, collate_fn=collator, num_workers=workers
            )
            batches[f"prepare_data_loader({name}, {workers} workers)"] = next(iter(trainer.prepare_data_loader(loader)))
    spec_2d = "{devices=[4,1]0,1,2,3}"
    for path, batch in batches.items():
        specs = {k: torch_xla_spec(v) for k, v in batch.items()}
        print(f"{path}: {type(batch).__name__} {specs}")
        assert type(batch) is BatchEncoding, f"{path}: came back as {type(batch).__name__}"
        assert set(specs.values()) == {spec_2d}, f"{path}: not every tensor split over the 4 devices: {specs}"
    for path in ("to_device(tokenizer output)", "trainer.to_device(tokenizer output)"):
        assert batches[path].encodings is not None and len(batches[path].encodings) == 4, f"{path}: encodings lost"
    batch = batches["prepare_data_loader(DataCollatorForLanguageModeling, 0 workers)"]
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss.detach().cpu()), "a step on the sharded BatchEncoding"


def torch_xla_spec(t):
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


SCENARIOS = {f.__name__: (f, eager) for f, eager in (  # name -> (XLA scenario, eager reference or None)
    (lm_lora, lm_lora_eager), (lm_lora_bf16, lm_lora_eager), (lm_fsdp, lm_full_eager), (resnet18_bn, resnet_eager),
    (gan_two_optimizers, gan_eager), (checkpoint_torch_utils, checkpoint_torch_utils_eager),
    (checkpoint_hf, checkpoint_hf_eager), (hf_save_pretrained_pin, None), (hf_attention_transfers_pin, None),
    (hf_batches_are_sharded, None), (lm_tensor_parallel, lm_tp_eager), (lm_lora_tensor_parallel, lm_lora_eager),
    (mistral_sliding_window, mistral_sliding_window_eager))}


def main(argv):
    name, eager = argv[0], "--eager" in argv[1:]
    scenario, reference = SCENARIOS[name]
    start = time.time()
    if eager:
        assert st.device_type() == "cpu", f"the eager reference must run on CPU, got {st.device_type()}"
        child.report(reference())
        return
    if name == "lm_tensor_parallel":  # XLA reads its flags once, when it starts
        import hlo

        dump = os.environ["SEAMLESS_TPU_HLO_DUMP"] = tempfile.mkdtemp()
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {hlo.DUMP_FLAGS.format(dump)}".strip()
    assert st.device_type() == "xla", (
        f"run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 SEAMLESS_TPU_DEVICE=xla, got {st.device_type()}"
    )
    scenario()
    child.report({"scenario": name, "seconds": round(time.time() - start, 1)})


if __name__ == "__main__":
    main(sys.argv[1:])
