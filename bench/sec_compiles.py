"""Section compiles: XLA graphs compiled (UncachedCompile) per step over 3 epochs of a dataset whose last batch is
short, through the shim and in the loop most people write first."""

from harness import THREADS, XLA_ENV, ask_once
from workers import handwritten_xla


def compiles_over_epochs(name, samples=70, batch=8, epochs=3):
    """Comparison 3: UncachedCompile per step over 3 epochs of a dataset that batches unevenly."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    if name == "shim":
        import seamless_tpu as st

        prepared = st.SeamlessTPUTrainer(model).prepare_data_loader(loader)

        def epoch():
            return prepared
    else:  # the loop most people write first: no drop_last
        put = handwritten_xla(model)

        def epoch():
            return ((put(x), put(y)) for x, y in loader)
    counts = []
    for _ in range(epochs):
        for x, y in epoch():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if name != "shim":
                torch_xla.sync()
            counts.append(met.counter_value("UncachedCompile") or 0)
    return counts


def run_compiles(s):
    return {name: ask_once(name, XLA_ENV, "compiles")["counts"] for name in ("shim", "handwritten_xla")}


def render_compiles(compiles, s):
    md, headline = [], []
    for name, counts in compiles.items():
        warm = counts[min(1, len(counts) - 1)]
        md.append(
            f"- {name}: {len(counts)} steps, UncachedCompile after step 2 = {warm}, at the end = {counts[-1]} "
            f"(growth after warm-up: {counts[-1] - warm})"
        )
        headline.append(f"compiles after warm-up over 3 epochs: {name} +{counts[-1] - warm}")
    return md, headline
