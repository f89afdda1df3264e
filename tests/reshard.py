"""One side of a checkpoint reshard test (tests/test_real_xla.py runs pairs of these).

    python tests/reshard.py LAYOUT save|load DIR

LAYOUT is fsdp4, ddp4, fsdp2 (real torch_xla SPMD on 4 or 2 virtual CPU devices: the caller sets
CPU_NUM_DEVICES) or eager (plain CPU, torch_xla blocked from importing). 'save' trains 5 steps,
saves, trains 5 more and prints those 5 losses (the uninterrupted run); 'load' builds the model
from another seed, loads, checks the weights against consolidate_checkpoint bitwise, and prints
the 5 losses it trains next. Prints one JSON line.
"""

import json
import sys

LAYOUT, PHASE, DIRECTORY = sys.argv[1:4]
if LAYOUT == "eager":
    sys.modules["torch_xla"] = None  # proves the eager side needs no torch_xla

import torch  # noqa: E402

import seamless_tpu as st  # noqa: E402
from scenarios import run_steps  # noqa: E402  (the real tier's plain loop)


def model_and_data(seed):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), torch.nn.Linear(32, 32))
    g = torch.Generator().manual_seed(0)
    return model, torch.randn(8, 8, 32, generator=g), torch.randn(8, 8, 32, generator=g)


def train(model, optimizer, x, y, steps):
    return run_steps(model, optimizer, x, y, steps).tolist()


def main():
    strategy = "fsdp" if LAYOUT.startswith("fsdp") else "ddp"
    model, x, y = model_and_data(0 if PHASE == "save" else 123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = st.SeamlessTPUTrainer(model, device="cpu" if LAYOUT == "eager" else "xla", strategy=strategy)
    x, y = trainer.to_device(x, y)
    report = {"layout": LAYOUT, "torch_xla_imported": sys.modules.get("torch_xla") is not None}
    if PHASE == "save":
        train(model, optimizer, x, y, 5)
        trainer.save_checkpoint(DIRECTORY, model=model, optimizer=optimizer, epoch=5)
        report["losses"] = train(model, optimizer, x, y, 5)
    else:
        values = trainer.load_checkpoint(DIRECTORY, model=model, optimizer=optimizer)
        saved = st.consolidate_checkpoint(DIRECTORY)
        report["bitwise"] = all(torch.equal(v.cpu(), saved["model"][k]) for k, v in model.state_dict().items())
        report["epoch"] = values["epoch"]
        if strategy == "fsdp":
            import torch_xla

            report["sharded"] = all(torch_xla._XLAC._get_xla_sharding_spec(p).startswith("{devices=")
                                    for p in model.parameters() if p.dim() == 2)
        report["losses"] = train(model, optimizer, x, y, 5)
    print("REPORT" + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
