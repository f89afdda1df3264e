"""Issues 40 and 49: every torch.optim optimizer (LBFGS: tests/loops.py; SparseAdam needs sparse gradients, which XLA
has not), each plain, with an LR scheduler and with gradient clipping (and AdamW with a warmup from lr 0), on a tiny
MLP through the trainer (XLA) or as written (eager, SEAMLESS_TPU_DEVICE=cpu).

    python tests/first_step.py GROUP...  # a key of GROUPS, a case (adam/clip) or "all"; reports (child.report)
    {case: {"losses": [...], "weights": [...], "state": [...], "compiles": [after each step], "split_like": bool,
            "pinned": int}}

"compiles" counts torch_xla's UncachedCompile from the case's start. Each case's MLP has a width of its own, so no
case meets a graph another compiled in the same process. "state" is the optimizer's state after the last step,
every tensor in parameter then key order (Adam's step counts included). "split_like": every state tensor of a
parameter's shape, and its gradient, is laid out like its parameter (fsdp: split, the same bytes per device).
"pinned": the calls of its step whose floats _OwnScalars made device scalars (each step pays its mode).
"""

import sys

import torch
import torch.nn.functional as F

import child
import seamless_tpu as st

STEPS = 8  # RAdam's step takes its other branch from step 6 (rho_t > 5)
OPTIMIZERS = {  # name -> (the optimizer, the trainer's strategy)
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),  # 1 - lr x wd = beta2 (till lr moves)
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "adamw_fsdp": lambda p: torch.optim.AdamW(p, lr=0.01),
    # torch's own device-side scalars (issue 62): the step count and a tensor lr on the device; eager: the same sums
    "adamw_capturable": lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.01), capturable=st.is_xla_backend(),
                                                    weight_decay=0.1),  # torch refuses it on the CPU
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, eps=1e-4),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(p, lr=0.001, eps=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01, eps=1e-6),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=0.01),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.01),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=0.5),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),  # writes sign[sign.gt(0)] = etaplus: a boolean-mask index_put_
    "muon": lambda p: torch.optim.Muon(matrices_only(p), lr=0.01),
}


def matrices_only(params):
    """Muon steps matrices: the biases are frozen here (its users give them to another optimizer); left to
    accumulate, their gradients made step 2's backward a graph of its own, in eager and on XLA alike."""
    params = list(params)
    for p in params:
        p.requires_grad_(p.dim() == 2)
    return [p for p in params if p.dim() == 2]


VARIANTS = ("plain", "scheduler", "clip")
GROUPS = {"sgd": ("sgd", "sgd_momentum", "sgd_nesterov", "sgd_dampening"),
          "adam": ("adam", "adamw", "adamw_amsgrad", "adamw_fsdp"),
          "others": ("rmsprop", "rmsprop_centered", "adagrad", "adafactor"),
          "more": ("nadam", "radam", "adamax", "asgd"), "rest": ("adadelta", "rprop", "muon", "adamw_capturable")}
CASES = [f"{name}/{variant}" for group in GROUPS.values() for name in group for variant in VARIANTS] + ["adamw/warmup"]


def mlp(width):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


def run(case, width):
    """The plain loop, the optimizer made before the model moves, as users write it."""
    name, variant = case.split("/")
    model = mlp(width)
    optimizer = OPTIMIZERS[name](model.parameters())
    scheduler = {"scheduler": lambda: torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.8),  # a warmup from lr 0:
                 "warmup": lambda: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, i / 4))}.get(
        variant, lambda: None)()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 12, generator=g), torch.randn(32, 4, generator=g)
    xla = st.is_xla_backend()
    if xla:
        trainer = st.SeamlessTPUTrainer(model, strategy="fsdp" if name.endswith("_fsdp") else "ddp")
        x, y = trainer.to_device(x, y)
    met = sys.modules.get("torch_xla.debug.metrics") if xla else None
    counter = (lambda: met.counter_value("UncachedCompile") or 0) if xla else (lambda: 0)
    start, losses, compiles = counter(), [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if variant == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.detach())
        compiles.append(counter() - start)
    split_like = True
    if xla:
        spec = __import__("torch_xla")._XLAC._get_xla_sharding_spec
        split_like = all(spec(v) == spec(p) for p in model.parameters() if p.requires_grad
                         for v in [p.grad, *optimizer.state[p].values()]
                         if v.shape == p.shape)
    state = [v.detach().cpu().float().flatten() for p in model.parameters() for _, v in
             sorted(optimizer.state[p].items()) if isinstance(v, torch.Tensor)]
    return {"losses": torch.stack(losses).cpu().tolist(),
            "weights": torch.cat([p.detach().cpu().flatten() for p in model.parameters()]).tolist(),
            "state": torch.cat(state).tolist() if state else [], "compiles": compiles, "split_like": split_like,
            "pinned": len(st._STATE.steps[optimizer].pinned) if xla else 0}


def main(*names):
    st.get_device()  # XLA first: a CPU backward before it would break XLA's autograd
    picked = {n for name in names for n in GROUPS.get(name, (name,))}
    cases = [c for c in CASES if {"all", c, c.split("/")[0]} & picked]
    child.report({case: run(case, 16 + 4 * CASES.index(case)) for case in cases})


if __name__ == "__main__":
    main(*sys.argv[1:])
