"""Fast tier: what a run costs, on the CPU path and through the fake torch_xla (issue 28).

trainer.stats() counts steps, samples, tokens and FLOPs at step ends with no sync; trainer.log() reads values on
its own thread and writes one line per log_every steps; trainer.profile() writes a trace; describe() reads the
tensors. The compile cache is proven here by contract (the fake TPU) and on the real library in
tests/test_real_xla.py, with the rest of the XLA path (tests/work_split.py, tests/scenarios.py run_costs).
"""

import glob
import gzip
import json
import logging
import os
import socket
import time
import types

import pytest
import torch
import torch.nn.functional as F

import scenarios
import seamless_tpu as st
import work_split
from fake_torch_xla import FakeXLA

pytestmark = pytest.mark.fast


class Tokens(torch.nn.Module):
    """A language model's shape: integer ids (B, T) in, a loss out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)

    def forward(self, ids):
        return F.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), ids.flatten())


def train(model, optimizer, trainer, steps, batch=16, log=None):
    losses = []
    for step in range(1, steps + 1):
        x, y = scenarios.data(batch, seed=step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if log:
            trainer.log(step, loss=loss, lr=optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def clock(monkeypatch, times):
    """The module's time with perf_counter reading `times` in turn: the step ends' times, set by the test (only a
    step end of a trainer's optimizer reads it)."""
    fake = types.ModuleType("time")
    fake.__dict__.update(vars(time))
    fake.perf_counter = iter(times).__next__
    monkeypatch.setattr(st, "time", fake)


def test_stats_count_the_trainers_steps_samples_tokens_and_flops_and_time_them_without_a_sync(monkeypatch, fresh):
    """CPU: only steps of an optimizer of the trainer's parameters count, whatever else the process steps (a probe);
    samples are the model's first input's batch dim in forwards under grad (eval does not count); step_time_s is
    the time between the last RATE_WINDOW + 1 step ends over RATE_WINDOW, on a clock the test sets; FLOPs are the
    first step's, counted from its ops (x 2 for the first Linear: its input needs no gradient, x 3 for the second).
    MFU is None: no peak for a CPU."""
    ends = [0.25 * k * k for k in range(5 + st.RATE_WINDOW)]  # uneven: only the window's ends give 7.0 s a step
    clock(monkeypatch, ends)
    model = scenarios.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = torch.nn.Linear(10, 1)  # a loop's own optimizer, stepped as often as the trainer's
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.01)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    assert trainer.stats()["steps"] == 0 and trainer.stats()["step_time_s"] is None
    with torch.no_grad():
        model(torch.ones(100, 10))  # an eval forward: not the step's work
    for step in range(1, 6 + st.RATE_WINDOW):
        train(model, optimizer, trainer, 1)
        probe(torch.ones(4, 10)).sum().backward()
        probe_opt.step()
    stats = trainer.stats()
    flops = 2 * 16 * 10 * 32 * 2 + 2 * 16 * 32 * 1 * 3
    assert stats["steps"] == 5 + st.RATE_WINDOW and stats["samples"] == 16 * stats["steps"] and stats["tokens"] == 0
    assert stats["flops_from"] == "flop_counter" and stats["flops_per_device"] == flops
    assert stats["step_time_s"] == (ends[-1] - ends[-1 - st.RATE_WINDOW]) / st.RATE_WINDOW == 7.0
    assert stats["samples_per_s"] == 16 * st.RATE_WINDOW / 140.0
    assert stats["tflops_per_device"] == flops / 7.0 / 1e12
    assert stats["mfu"] is None and stats["peak_tflops"] is None and stats["device_time_s"] is None

    clock(monkeypatch, [10.0, 11.0, 12.0])
    lm = Tokens()
    lm_opt = torch.optim.SGD(lm.parameters(), lr=0.01)
    lm_trainer = st.SeamlessTPUTrainer(lm, device="cpu")
    for _ in range(3):
        lm(torch.randint(50, (4, 7))).backward()
        lm_opt.step()
    stats = lm_trainer.stats()
    assert stats["tokens"] == 3 * 28 and stats["flops_from"] == "flop_counter"
    assert stats["flops_per_device"] == 2 * 28 * 16 * 50 * 3  # the head's product: the embedding has none
    assert stats["tokens_per_s"] == 28 / 1.0


class Scale(torch.nn.Module):
    """Nothing torch's FLOP formulas know (no product): no FLOPs, and no formula's guess."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(10))

    def forward(self, x):
        return x * self.w


def test_stats_give_no_flops_where_nothing_was_counted(monkeypatch, fresh):
    clock(monkeypatch, [1.0, 2.0, 3.0])
    model = Scale()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    for _ in range(3):
        model(torch.ones(8, 10)).sum().backward()
        optimizer.step()
    stats = trainer.stats()
    assert stats["steps"] == 3 and stats["samples_per_s"] == 8.0
    assert stats["flops_from"] is None and stats["flops_per_device"] is None and stats["mfu"] is None


def hand_count(name):
    """(model, batch, loss of (model, batch), the step's FLOPs by hand): 2 x m x n x k a product, x 3 forward and
    backward (x 2 where its input needs no gradient); SDPA 2 products forward, 5 backward (torch's kernels recompute
    the scores)."""
    if name == "x @ W":
        x, rows = torch.randn(4, 6, 10), 4 * 6
        flops = 2 * rows * 10 * 64 * 2 + 2 * rows * 64 * 3 * 3
        return scenarios.MatmulNet(), x, lambda m, b: m(b).square().mean(), flops
    if name == "conv":
        model, (x, _), _ = work_split.build("conv")
        x, rows = x[:4], 4 * 16 * 16
        flops = 2 * rows * 3 * 16 * 9 * 2 + 2 * rows * 16 * 16 * 9 * 3 + 2 * 4 * 16 * 10 * 3
        return model, x, lambda m, b: m(b).square().mean(), flops
    model, batch, loss_of = work_split.build("gpt")
    b, t, e, v = work_split.B, work_split.T, work_split.E, work_split.V
    block = 2 * b * t * (e * 3 * e + e * e + e * 4 * e + 4 * e * e) * 3 + 2 * b * t * t * e * (2 + 5)
    return model, batch, loss_of, 2 * block + 2 * b * t * e * v * 3


@pytest.mark.parametrize("name", ["gpt", "x @ W", "conv"])
def test_flops_and_mfu_are_the_first_steps_products_attention_and_convolutions(monkeypatch, fresh, name):
    """The FLOPs stats report are those the step ran, counted from its ops' shapes: on a 2-block SDPA GPT, a model
    of x @ W products and a conv net, equal to a hand count; MFU is that over the step time and a peak."""
    clock(monkeypatch, [1.0, 1.5, 2.0])
    monkeypatch.setattr(st, "_peak_flops", lambda kind: 1e12)  # a CPU has none: MFU would be None
    model, batch, loss_of, flops = hand_count(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    for _ in range(3):
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = trainer.stats()
    assert stats["flops_from"] == "flop_counter" and stats["flops_per_device"] == flops, (stats, flops)
    assert stats["mfu"] == flops / 0.5 / 1e12 and stats["peak_tflops"] == 1.0


def test_xla_flops_come_from_the_calls_with_no_dispatch_mode(fresh):
    """On XLA no dispatch mode may run (torch_xla 2.9 drops in-place writes to views under one): _FunctionFlops
    counts the matmul-like calls from their shapes, x 1 + 1 per operand the backward computes a gradient of; an
    einsum's from its equation (2 x every index's size); a call inside a counted one (F.linear's own kernel) is not
    seen again. Off XLA the dispatch mode counts what runs."""
    assert st._einsum_flops("...n,mn->...m", [(4, 6, 10), (64, 10)]) == 2 * 4 * 6 * 10 * 64
    assert st._einsum_flops("bhqd, bhkd -> bhqk", [(2, 4, 5, 8), (2, 4, 7, 8)]) == 2 * 2 * 4 * 5 * 7 * 8
    assert st._einsum_flops("...ij,...jk", [(3, 1, 4, 5), (2, 5, 6)]) == 2 * 3 * 2 * 4 * 5 * 6
    x, w, forward = torch.randn(4, 6, 10), torch.randn(64, 10, requires_grad=True), 2 * 4 * 6 * 10 * 64
    count = st._FlopCount(xla=True).start()
    assert torch._C._len_torch_dispatch_stack() == 0, "no dispatch mode on XLA"
    torch.einsum("...n,mn->...m", x, w)
    with torch.no_grad():
        torch.einsum("...n,mn->...m", [x, w])
    torch.nn.functional.linear(x, w)  # its aten kernel's matmuls are inside the counted call
    x @ w.T
    torch.nn.functional.conv2d(torch.randn(2, 3, 8, 8), torch.randn(5, 3, 3, 3, requires_grad=True), padding=1)
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    lstm = torch.nn.LSTM(10, 16, batch_first=True)
    lstm(x)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[:, -2:] = False  # in place, on a view
    conv = 2 * 2 * 5 * 8 * 8 * 27 * 2
    sdpa = 2 * 2 * 4 * 6 * 6 * (8 + 8) + 2 * 2 * 4 * 6 * 6 * 2 * (8 + 8)  # XLA's backward: 4 products
    rnn = sum(2 * 24 * n * (1 + 1 + (i > 0)) for i, n in enumerate((64 * 10, 64 * 16)))
    assert count.stop() == forward * 2 + forward + forward * 2 * 2 + conv + sdpa + rnn
    assert mask.sum() == 6
    count = st._FlopCount(xla=False).start()
    torch.einsum("...n,mn->...m", x, w)
    assert count.stop() == forward, "the bmm, once"


def test_the_count_runs_one_step_and_never_outlives_it(fresh):
    """The count's mode is in force from the first training forward until the trainer's optimizer steps: not for
    forwards under no_grad, nor inside a mode of the user's (theirs may end first), nor past FLOP_FORWARDS forwards
    that never step; _reset_caches ends one left open."""
    from torch.utils.flop_counter import FlopCounterMode

    def modes():
        return torch._C._len_torch_dispatch_stack()

    model, x = scenarios.MatmulNet(), torch.randn(4, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    with torch.no_grad():
        model(x)
    assert modes() == 0
    with FlopCounterMode(display=False) as theirs:
        model(x).sum().backward()
        assert modes() == 1, "theirs only"
    assert theirs.get_total_flops() == 2 * 4 * 10 * 64 * 2 + 2 * 4 * 64 * 3 * 3
    for _ in range(st.FLOP_FORWARDS):
        model(x)
        assert modes() == 1, "ours, from the first forward outside theirs"
    model(x)
    assert modes() == 0 and st._STATE.meter.step_flops == 0, "forwards that never step: counted no more"
    optimizer.step()
    model(x)
    optimizer.step()
    assert modes() == 0
    assert trainer.stats()["flops_from"] is None

    other = st.SeamlessTPUTrainer(scenarios.MatmulNet(), device="cpu")  # a trainer after a step counts afresh
    other.model(x)
    assert modes() == 1
    st._reset_caches()
    assert modes() == 0


def test_a_compiled_model_compiles_as_without_the_count_and_counts_the_same(monkeypatch, fresh, tmp_path):
    """torch.compile (aot_eager) under the count: one graph, as without it, and the eager count's FLOPs."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # torch.compile sets it where unset
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", 8)
    torch._dynamo.reset()
    clock(monkeypatch, [1.0, 2.0, 3.0])
    model, batch, loss_of, flops = hand_count("x @ W")
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = st.SeamlessTPUTrainer(compiled, device="cpu")
    losses = []
    for _ in range(3):
        loss = loss_of(compiled, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1 and trainer.stats()["flops_per_device"] == flops


@pytest.mark.parametrize("name,kind,want", [
    ("TPU v4", "tpu", 275e12), ("v5litepod-16", "tpu", 197e12), ("TPU v5 lite", "tpu", 197e12),
    ("v5p-128", "tpu", 459e12), ("TPU v5", "tpu", 459e12), ("v6e-8", "tpu", 918e12), ("TPU v6 lite", "tpu", 918e12),
    ("TPU7x", "tpu", 1153.5e12), ("NVIDIA A100-SXM4-80GB", "gpu", 312e12), ("NVIDIA H100 80GB HBM3", "gpu", 989e12),
    ("NVIDIA H100 PCIe", "gpu", 756e12), ("NVIDIA H200", "gpu", 989e12), ("NVIDIA B200", "gpu", 2250e12),
    ("Tesla T4", "gpu", None), ("", "cpu", None), ("", "xla", None)])
def test_mfu_peaks_per_device_are_the_cited_dense_bf16_figures(monkeypatch, fresh, name, kind, want):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", name) if kind == "tpu" else None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert st._peak_flops(kind) == want


def test_log_writes_the_means_of_every_log_every_steps_with_throughput_to_the_logger_and_the_hook(fresh, caplog):
    """Lines at steps 2 and 4 hold the means of the values logged since the line before; the hook gets the same
    dict. Nothing but numbers and one-element tensors is taken, with the rule in the error."""
    lines = []
    model = scenarios.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = st.SeamlessTPUTrainer(model, device="cpu", log_every=2, log_to=lines.append, progress=False)
    with caplog.at_level(logging.INFO, logger="seamless_tpu"):
        losses = train(model, optimizer, trainer, 4, log=True)
        st._STATE.run_log.close()  # the lines in flight are written
    assert [line["step"] for line in lines] == [2, 4]
    assert lines[0]["loss"] == pytest.approx(sum(losses[:2]) / 2)
    assert lines[1]["loss"] == pytest.approx(sum(losses[2:]) / 2)
    assert lines[1]["lr"] == 0.01 and lines[1]["samples_per_s"] > 0
    text = [r.getMessage() for r in caplog.records if "step 4 " in r.getMessage()]
    assert len(text) == 1 and f"loss {lines[1]['loss']:.4g}" in text[0] and "samples_per_s" in text[0], text
    with pytest.raises(TypeError, match=r"takes numbers and one-element tensors, got x=tensor\(\[1\., 2\.\]\)"):
        trainer.log(5, x=torch.tensor([1.0, 2.0]))


def test_an_error_in_the_log_hook_is_raised_by_the_next_log_call(fresh):
    def hook(line):
        raise OSError("wandb is down")

    trainer = st.SeamlessTPUTrainer(scenarios.mlp(), device="cpu", log_every=1, log_to=hook, progress=False)
    trainer.log(1, loss=1.0)
    st._STATE.run_log.thread.submit(lambda: None).result()  # the line was written (and failed)
    with pytest.raises(RuntimeError, match=r"trainer.log\(\) failed on an earlier step: OSError\('wandb is down'\)"):
        trainer.log(2, loss=1.0)


def test_progress_bar_only_when_asked_or_on_a_terminal(fresh, capsys):
    trainer = st.SeamlessTPUTrainer(scenarios.mlp(), device="cpu", log_every=10)
    for step in range(1, 4):
        trainer.log(step, loss=1.0)
    st._STATE.run_log.close()
    assert "steps" not in capsys.readouterr().err, "stderr is not a terminal here: no bar unless asked"
    st._reset_caches()
    trainer = st.SeamlessTPUTrainer(scenarios.mlp(), device="cpu", log_every=10, progress=True)
    for step in range(1, 4):
        trainer.log(step, loss=1.0)
    st._STATE.run_log.close()
    assert "steps: 3" in capsys.readouterr().err


def test_profile_on_cpu_writes_a_chrome_trace_of_the_steps_ops_and_changes_no_loss(fresh, tmp_path):
    """torch.profiler's trace (TensorBoard's profile plugin reads *.pt.trace.json) of exactly `steps` steps, written
    when the last one ends; the losses are those of the same loop unprofiled, bitwise."""
    def run(profile):
        model = scenarios.mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        trainer = st.SeamlessTPUTrainer(model, device="cpu")
        losses = train(model, optimizer, trainer, 1)
        if not profile:
            return losses + train(model, optimizer, trainer, 2) + train(model, optimizer, trainer, 1)
        with trainer.profile(tmp_path, steps=2):
            losses += train(model, optimizer, trainer, 2)
            traces = glob.glob(str(tmp_path / "*.pt.trace.json*"))
            assert len(traces) == 1, "written when its second step ended, inside the block"
            losses += train(model, optimizer, trainer, 1)
        return losses, traces[0]

    plain = run(False)
    st._reset_caches()
    profiled, trace = run(True)
    assert profiled == plain
    opener = gzip.open if trace.endswith(".gz") else open
    with opener(trace, "rt") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"aten::addmm", "aten::mse_loss", "Optimizer.step#SGD.step"} <= names, sorted(names)[:50]
    with pytest.raises(RuntimeError, match="a trace into .* is in progress; one at a time"):
        trainer = st.SeamlessTPUTrainer(scenarios.mlp(), device="cpu")
        trainer.profile(tmp_path / "a"), trainer.profile(tmp_path / "b")


def test_describe_off_xla_lists_each_parameter_whole_and_the_totals(fresh):
    model = scenarios.mlp()
    optimizer = torch.optim.Adam(model.parameters())
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    train(model, optimizer, trainer, 1)
    table = trainer.describe(optimizer).splitlines()
    assert table[0] == "cpu, 1 process(es), no wrapper"
    assert table[2].split() == ["0.weight", "(32,", "10)", "[-,", "-]", "1.2", "KiB"]
    assert table[-2] == "parameters: 1.5 KiB per device of 1.5 KiB in one replica (1.00)"
    assert table[-1] == "optimizer state: 3.0 KiB per device of 3.0 KiB in one replica (1.00)"


@pytest.fixture
def fake_tpu(monkeypatch, fresh, tmp_path):
    """The fake torch_xla on a TPU VM: PJRT_DEVICE=TPU, a v5e slice, a home of our own."""
    fake = FakeXLA(pjrt_device="TPU").install(monkeypatch)
    for name in ("XLA_PERSISTENT_CACHE_PATH", "XLA_PERSISTENT_CACHE_READ_ONLY", st.COMPILE_CACHE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(st, "_tpu_chip_count", lambda: 4)
    yield fake
    for name in ("XLA_PERSISTENT_CACHE_PATH", "XLA_PERSISTENT_CACHE_READ_ONLY"):  # what the trainer set, not the user
        if os.environ.get(name) not in (None, "/mnt/cache"):
            del os.environ[name]


def step_on(trainer):
    model = trainer.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(trainer.to_device(torch.ones(8, 10))), trainer.to_device(torch.ones(8, 1))).backward()
    optimizer.step()


def test_tpu_compile_cache_is_set_before_the_first_compile_per_host_and_accelerator_once(fake_tpu, tmp_path):
    path = str(tmp_path / ".cache" / "seamless_tpu" / "xla_cache" / f"v5litepod-8-{socket.gethostname()}")
    step_on(st.SeamlessTPUTrainer(scenarios.mlp()))
    assert fake_tpu.cache_env == {"XLA_PERSISTENT_CACHE_PATH": path, "XLA_PERSISTENT_CACHE_READ_ONLY": "0"}, (
        "torch_xla read the cache's env at its first compile")
    st._STATE.env_we_set.clear()
    step_on(st.SeamlessTPUTrainer(scenarios.mlp()))
    assert st._STATE.env_we_set == {}, "never twice"


@pytest.mark.parametrize("setting", ["off", "PATH", "user's own"])
def test_tpu_compile_cache_follows_the_users_choice(fake_tpu, monkeypatch, tmp_path, setting):
    if setting == "user's own":
        monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", "/mnt/cache")
    else:
        monkeypatch.setenv(st.COMPILE_CACHE_ENV, str(tmp_path / "shared") if setting == "PATH" else "off")
    step_on(st.SeamlessTPUTrainer(scenarios.mlp()))
    want = {"off": {}, "user's own": {"XLA_PERSISTENT_CACHE_PATH": "/mnt/cache"},
            "PATH": {"XLA_PERSISTENT_CACHE_PATH": str(tmp_path / "shared" / f"v5litepod-8-{socket.gethostname()}"),
                     "XLA_PERSISTENT_CACHE_READ_ONLY": "0"}}[setting]
    assert fake_tpu.cache_env == want


def test_compile_cache_stays_off_on_xla_cpu_and_says_so_when_asked(monkeypatch, fresh, caplog):
    fake = FakeXLA().install(monkeypatch)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv(st.COMPILE_CACHE_ENV, "/tmp/cache")
    with caplog.at_level(logging.INFO, logger="seamless_tpu"):
        step_on(st.SeamlessTPUTrainer(scenarios.mlp(), device="xla"))
    assert fake.cache_env == {}
    assert any("SEAMLESS_TPU_COMPILE_CACHE=/tmp/cache ignored: torch_xla 2.9 cannot read its compile cache back on "
               "XLA:CPU" in r.getMessage() for r in caplog.records)


def test_stats_and_log_through_the_fake_read_no_value_mid_step(monkeypatch, fresh):
    """The fake's tensors are all device data: log() hands them to its thread at once, which reads them in one
    transfer; stats() reads counters only."""
    fake = FakeXLA().install(monkeypatch)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    trainer = st.SeamlessTPUTrainer(scenarios.mlp(), device="xla", log_every=1, progress=False)
    step_on(trainer)
    step_on(trainer)
    before = fake.transfers
    stats = trainer.stats()
    assert fake.transfers == before
    # the first step's products: 2 x 8 rows x weights, x 2 for the first (its input needs no gradient), x 3
    # for the second, over the 4 devices
    assert stats["flops_from"] == "flop_counter"
    assert stats["flops_per_device"] == (2 * 8 * 320 * 2 + 2 * 8 * 32 * 3) / 4
    trainer.log(1, loss=torch.ones(()).to(trainer.device), acc=torch.ones(()).to(trainer.device))
    st._STATE.run_log.close()
    assert fake.transfers == before + 1
