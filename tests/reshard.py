"""One side of a checkpoint reshard test (tests/test_real_xla.py runs pairs of these).

    python tests/reshard.py LAYOUT save|load DIR

LAYOUT is fsdp4, ddp4, fsdp2 (real torch_xla SPMD on 4 or 2 virtual CPU devices: the caller sets
CPU_NUM_DEVICES), tp2x2 (4 devices as 2 fsdp x 2 model, with TP_PLAN), dp2fsdp2 (4 devices as 2 data x 2
fsdp: the mesh of a 2-host slice, every parameter split on one axis and replicated on the other), eager
(plain CPU, torch_xla blocked from importing) or gloo2 (one of 2 CPU ranks running torch's FSDP2: the
caller starts both, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; each rank trains on its half of the
batch). 'save' trains 10 steps, saves, trains 10 more (the
uninterrupted run); 'load' builds the model from another seed, loads, checks the weights against
consolidate_checkpoint bitwise, and trains 10 steps. Reports (child.report) the losses (of the
whole batch: averaged over the ranks) and the checks.
"""

import sys

import child

LAYOUT, PHASE, DIRECTORY = sys.argv[1:4]
if LAYOUT in ("eager", "gloo2"):
    sys.modules["torch_xla"] = None  # proves the eager side needs no torch_xla

import torch  # noqa: E402

import seamless_tpu as st  # noqa: E402
from scenarios import run_steps  # noqa: E402  (the real tier's plain loop)


TP_PLAN = {"0.layers.*.linear1": "colwise", "0.layers.*.linear2": "rowwise", "1": "colwise"}


def model_and_data(seed):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), torch.nn.Linear(32, 32)
    )
    g = torch.Generator().manual_seed(0)
    return model, torch.randn(8, 8, 32, generator=g), torch.randn(8, 8, 32, generator=g)


def train(model, optimizer, x, y, steps):
    losses = run_steps(model, optimizer, x, y, steps)
    if LAYOUT == "gloo2":
        torch.distributed.all_reduce(losses)
        losses /= torch.distributed.get_world_size()
    return losses.tolist()


def main():
    strategy = "ddp" if LAYOUT in ("ddp4", "eager") else "fsdp"
    tp = {"tp2x2": {"xla_spmd_config": {"model_parallel_size": 2}, "tp_plan": TP_PLAN},
          "dp2fsdp2": {"xla_spmd_config": {"mesh_shape": [2, 2], "axis_names": ["data", "fsdp"]}}}.get(LAYOUT, {})
    model, x, y = model_and_data(0 if PHASE == "save" else 123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if LAYOUT == "gloo2":
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
        x, y = x.chunk(2)[rank], y.chunk(2)[rank]
    trainer = st.SeamlessTPUTrainer(
        model, device="cpu" if LAYOUT in ("eager", "gloo2") else "xla", strategy=strategy, **tp
    )
    x, y = trainer.to_device(x, y)
    report = {"layout": LAYOUT, "torch_xla_imported": sys.modules.get("torch_xla") is not None}
    if PHASE == "save":
        report["before"] = train(model, optimizer, x, y, 10)
        trainer.save_checkpoint(DIRECTORY, model=model, optimizer=optimizer, epoch=10)
        report["losses"] = train(model, optimizer, x, y, 10)
    else:
        chosen = None
        if trainer.mesh is not None:  # a layout the user chose for one weight must survive the load
            import torch_xla
            import torch_xla.distributed.spmd as xs

            head = model[1].weight
            xs.clear_sharding(head)
            xs.mark_sharding(head, trainer.mesh, (None, trainer.mesh.axis_names[0]))
            chosen = torch_xla._XLAC._get_xla_sharding_spec(head)
        values = trainer.load_checkpoint(DIRECTORY, model=model, optimizer=optimizer)
        if chosen is not None:
            report["user_sharding_kept"] = [chosen] * 2 == [torch_xla._XLAC._get_xla_sharding_spec(t)
                                                            for t in (head, optimizer.state[head]["exp_avg"])]
        saved = st.consolidate_checkpoint(DIRECTORY)
        report["bitwise"] = all(
            torch.equal(getattr(v, "full_tensor", lambda: v)().cpu(), saved["model"][k])
            for k, v in model.state_dict().items()
        )
        report["epoch"] = values["epoch"]
        if LAYOUT == "gloo2":
            report["sharded"] = all(
                p.to_local().shape[0] == p.shape[0] // 2 for p in model.parameters() if p.dim() == 2
            )
        elif strategy == "fsdp":
            import torch_xla

            matrices = [p for p in model.parameters() if p.dim() == 2]
            state = [optimizer.state[p][k] for p in matrices for k in ("exp_avg", "exp_avg_sq")]
            report["sharded"] = all(
                torch_xla._XLAC._get_xla_sharding_spec(t).startswith("{devices=") for t in matrices + state
            )
            if LAYOUT == "tp2x2":  # the plan's weights split 4 ways (2 model x 2 fsdp), and their Adam state alike
                planned = [model[0].layers[0].linear1.weight, model[0].layers[1].linear2.weight]
                report["sharded"] &= all(torch_xla._XLAC._get_xla_sharding_spec(t).startswith("{devices=[2,2]")
                                         for p in planned for t in (p, optimizer.state[p]["exp_avg"]))
        report["losses"] = train(model, optimizer, x, y, 10)
    child.report(report)


if __name__ == "__main__":
    main()
