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

import pytest
import torch
import torch.nn.functional as F

import scenarios
import seamless_tpu as st
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


def test_stats_count_steps_samples_tokens_and_flops_and_time_the_steps_without_a_sync(fresh):
    """CPU: samples are the model's first input's batch dim in forwards under grad (eval does not count), FLOPs
    are the stated 6 x trainable parameters x samples, or x tokens for integer ids, and the step time agrees with
    the wall time of the last RATE_WINDOW steps, bracketed by hand, within 10%. MFU is None: no peak for a CPU."""
    model = scenarios.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    assert trainer.stats()["steps"] == 0 and trainer.stats()["step_time_s"] is None
    train(model, optimizer, trainer, 5)
    with torch.no_grad():
        model(torch.ones(100, 10))  # an eval forward: not the step's work
    start = time.perf_counter()
    train(model, optimizer, trainer, st.RATE_WINDOW)
    wall = (time.perf_counter() - start) / st.RATE_WINDOW
    stats = trainer.stats()
    params = sum(p.numel() for p in model.parameters())
    assert stats["steps"] == 5 + st.RATE_WINDOW and stats["samples"] == 16 * stats["steps"] and stats["tokens"] == 0
    assert stats["flops_from"] == "6*params*samples" and stats["flops_per_device"] == 6 * params * 16
    assert abs(stats["step_time_s"] / wall - 1) <= 0.10, (stats["step_time_s"], wall)
    assert stats["samples_per_s"] == pytest.approx(16 / stats["step_time_s"])
    assert stats["tflops_per_device"] == pytest.approx(6 * params * 16 / stats["step_time_s"] / 1e12)
    assert stats["mfu"] is None and stats["peak_tflops"] is None and stats["device_time_s"] is None

    lm = Tokens()
    lm_opt = torch.optim.SGD(lm.parameters(), lr=0.01)
    lm_trainer = st.SeamlessTPUTrainer(lm, device="cpu")
    for _ in range(3):
        lm(torch.randint(50, (4, 7))).backward()
        lm_opt.step()
    stats = lm_trainer.stats()
    assert stats["tokens"] == 3 * 28 and stats["flops_from"] == "6*params*tokens"
    assert stats["flops_per_device"] == 6 * sum(p.numel() for p in lm.parameters()) * 28
    assert stats["tokens_per_s"] == pytest.approx(28 / stats["step_time_s"])


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
    # the first step's matmul modules: 2 x 8 rows x weights, x 2 for the first (its input needs no gradient), x 3
    # for the second, over the 4 devices
    assert stats["flops_from"] == "matmul_modules"
    assert stats["flops_per_device"] == (2 * 8 * 320 * 2 + 2 * 8 * 32 * 3) / 4
    trainer.log(1, loss=torch.ones(()).to(trainer.device), acc=torch.ones(()).to(trainer.device))
    st._STATE.run_log.close()
    assert fake.transfers == before + 1
