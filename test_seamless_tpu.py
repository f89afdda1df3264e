"""Fast tier: in-process, no XLA runtime, no Ray cluster. A fake torch_xla (tests/fake_torch_xla.py) stands in
for the library; tests/test_real_xla.py runs the same scenarios on the real one. The fixtures
(hygiene, fresh, no_xla, cpu, fake) are in conftest.py; what to_device does with batches is in
tests/test_inputs.py; every test that starts a process (gloo ranks, the example, SIGTERM) is in tests/test_procs.py.
Faults (a slow or failing checkpoint commit) come from tests/faults.py."""

import concurrent.futures
import contextlib
import logging
import os
import re
import sys
import threading
import types

import pytest
import torch

import child
import faults
import scenarios
import seamless_tpu as st
from fake_torch_xla import FakeXLA

pytestmark = pytest.mark.fast

NEVER_READ = scenarios.NEVER_READ


# --- device detection ----------------------------------------------------------------------------

# (torch_xla importable, PJRT_DEVICE, TPU chips, TPU_ACCELERATOR_TYPE, cuda, SEAMLESS_TPU_DEVICE) -> kind.
# PJRT_DEVICE "lib:X" is X written by torch_xla's own import (transformers imports it); a plain
# value is the user's, there when the process started.
DETECTION = [
    (False, None, 0, None, False, None, "cpu"),
    (False, None, 0, None, True, None, "gpu"),
    (False, "TPU", 4, None, False, None, "cpu"),  # no torch_xla: TPU hints alone do not count
    (True, None, 0, None, False, None, "cpu"),
    (True, None, 0, None, True, None, "gpu"),
    (True, None, 4, None, True, None, "tpu"),  # TPU before GPU
    (True, "TPU", 0, None, False, None, "tpu"),
    (True, "tpu", 0, None, False, None, "tpu"),
    (True, None, 0, "v5litepod-8", False, None, "cpu"),  # a hint without a chip is no TPU
    (True, None, 4, "v5litepod-8", False, None, "tpu"),
    (True, "CPU", 0, None, True, None, "xla"),  # XLA before GPU, when the user asked for it
    (True, "CPU", 4, None, False, None, "xla"),  # an explicit PJRT_DEVICE beats visible chips
    (True, "CUDA", 0, None, True, None, "xla"),
    (True, "lib:CPU", 0, None, False, None, "cpu"),  # torch_xla's guess is not the user's choice
    (True, "lib:CPU", 0, None, True, None, "gpu"),
    (True, "lib:CUDA", 0, None, True, None, "gpu"),
    (True, "lib:CPU", 4, None, False, None, "tpu"),
    (True, "", 0, None, True, None, "gpu"),  # '' means unset
    (True, "", 4, None, False, None, "tpu"),
    (True, "TPU", 4, None, True, "cpu", "cpu"),
    (True, "TPU", 4, None, True, "GPU", "gpu"),
    (True, "CPU", 0, None, False, "xla", "xla"),
    (True, "lib:CPU", 0, None, False, "xla", "xla"),
    (True, None, 0, None, True, "cuda:0", "gpu"),  # any torch.device string
    (True, None, 0, None, False, "cpu:0", "cpu"),
]


def set_detection_env(monkeypatch, xla, pjrt, chips, acc, cuda, asked):
    """The user's env is what the process started with; 'lib:' values appear only after torch_xla loads."""
    user = {}
    for name, value in (("PJRT_DEVICE", pjrt), ("TPU_ACCELERATOR_TYPE", acc), ("SEAMLESS_TPU_DEVICE", asked)):
        monkeypatch.delenv(name, raising=False)
        if value is not None and not value.startswith("lib:"):
            user[name] = value
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(st, "_initial_environ", lambda: user)
    if xla:
        FakeXLA().install(monkeypatch)
        if pjrt and pjrt.startswith("lib:"):
            monkeypatch.setenv("PJRT_DEVICE", pjrt[4:])
    else:
        monkeypatch.setitem(sys.modules, "torch_xla", None)
    monkeypatch.setattr(st, "_tpu_chip_count", lambda: chips)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


@pytest.mark.parametrize("xla,pjrt,chips,acc,cuda,asked,want", DETECTION)
def test_detection_matrix(monkeypatch, fresh, xla, pjrt, chips, acc, cuda, asked, want):
    set_detection_env(monkeypatch, xla, pjrt, chips, acc, cuda, asked)
    assert st.device_type() == want
    assert st.is_xla_backend() == (want in ("tpu", "xla"))


def test_detection_does_not_depend_on_import_order(monkeypatch, fresh):
    """The same answer before and after torch_xla's import writes PJRT_DEVICE=CPU."""
    set_detection_env(monkeypatch, True, None, 0, None, True, None)
    monkeypatch.delitem(sys.modules, "torch_xla")
    before = st.device_type()
    FakeXLA().install(monkeypatch)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # what 'import transformers' leaves behind
    assert before == st.device_type() == "gpu"


def test_user_pjrt_set_in_the_script_before_torch_xla_counts(monkeypatch, fresh):
    set_detection_env(monkeypatch, True, None, 0, None, True, None)
    monkeypatch.delitem(sys.modules, "torch_xla")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # os.environ[...] = "CPU" at the top of the script
    assert st.device_type() == "xla"
    FakeXLA().install(monkeypatch)  # then transformers imports torch_xla: the value stays the user's
    assert st.device_type() == "xla"


def test_empty_pjrt_means_unset_when_activating(monkeypatch, fresh):
    """PJRT_DEVICE='' is unset for activation too: it gets a real value, not torch_xla's 'not set' error."""
    set_detection_env(monkeypatch, True, "", 0, None, False, "xla")
    st.get_device()
    assert os.environ["PJRT_DEVICE"] == "CPU"


def test_tpu_request_with_a_hint_but_no_chip_names_the_hint(monkeypatch, fresh):
    set_detection_env(monkeypatch, True, None, 0, "v5litepod-8", False, None)
    with pytest.raises(
        RuntimeError,
        match=r"no TPU chip is visible.*TPU_ACCELERATOR_TYPE='v5litepod-8'.*names a TPU, but this host has no chip",
    ):
        st.get_device("tpu")


@pytest.mark.parametrize("layout,want", [
    ({"sys/bus/pci/devices/0000:00:04.0/vendor": "0x1ae0\n", "sys/bus/pci/devices/0000:00:05.0/vendor": "0x1ae0\n",
      "sys/bus/pci/devices/0000:00:06.0/vendor": "0x8086\n"}, ("Google PCI devices", 2)),
    ({"dev/accel0": "", "dev/accel1": ""}, ("/dev/accel[0-9]*", 2)),
    ({"dev/vfio/0": "", "dev/vfio/vfio": ""}, ("/dev/vfio/[0-9]*", 1)),  # the control node is no chip
    ({"sys/bus/pci/devices/0000:00:06.0/vendor": "0x10de\n"}, (None, 0)),
])
def test_tpu_chip_evidence(monkeypatch, tmp_path, fresh, layout, want):
    for rel, text in layout.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    real_glob = st.glob.glob
    monkeypatch.setattr(
        st.glob, "glob", lambda pattern: [p.replace(str(tmp_path), "") for p in real_glob(str(tmp_path) + pattern)]
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(str(tmp_path) + path if str(path).startswith("/sys") else path, *a, **k),
    )
    what, count = st._tpu_chips()
    assert (what, count) == want


def test_detection_has_no_side_effects(monkeypatch, fresh):
    """device_type() finds torch_xla without importing it (its import writes env defaults)."""
    if "torch_xla" in sys.modules:
        pytest.skip("torch_xla already imported in this process")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.delenv("SEAMLESS_TPU_DEVICE", raising=False)
    env = dict(os.environ)
    kind = st.device_type()
    assert kind == ("xla" if st._xla_installed() else "cpu")
    assert "torch_xla" not in sys.modules and dict(os.environ) == env


def test_no_torch_xla_errors_name_the_install_command(no_xla):
    for kind in ("tpu", "xla"):
        with pytest.raises(ImportError, match=r"needs torch_xla.*pip install 'torch_xla\[tpu\]==2\.9\.0'"):
            st.get_device(kind)
    with pytest.raises(ImportError, match=r"seamless_tpu needs torch_xla for this: pip install"):
        st.create_xla_mesh()


def test_tpu_requested_without_a_tpu(fake, monkeypatch):
    monkeypatch.setattr(st, "_tpu_chip_count", lambda: 0)
    monkeypatch.setattr(st, "_initial_environ", lambda: {"PJRT_DEVICE": "CPU"})
    with pytest.raises(
        RuntimeError, match=r"device 'tpu' was requested but no TPU chip is visible \(PJRT_DEVICE='CPU'"
    ):
        st.get_device("tpu")


def test_bad_kind_and_missing_gpu(cpu, monkeypatch):
    with pytest.raises(
        ValueError, match=r"device must be one of .* or a torch.device string like 'cuda:0', got 'tpuu'"
    ):
        st.get_device("tpuu")
    monkeypatch.setenv("SEAMLESS_TPU_DEVICE", "cudaa")
    with pytest.raises(ValueError, match=r"SEAMLESS_TPU_DEVICE must be one of .*got 'cudaa'"):
        st.device_type()
    monkeypatch.setenv("SEAMLESS_TPU_DEVICE", "cuda:1")
    with pytest.raises(RuntimeError, match=r"device 'cuda:1' was requested but torch.cuda.is_available\(\) is False"):
        st.device_type()
    with pytest.raises(RuntimeError, match=r"'gpu' was requested but torch.cuda.is_available\(\) is False"):
        st.get_device("gpu")


def test_cpu_device(cpu):
    assert st.get_device() == torch.device("cpu") and st.get_device("cpu") == torch.device("cpu")


# --- the trainer on CPU: bitwise equal to the plain loop -----------------------------------------


@pytest.mark.parametrize("opt_name", sorted(scenarios.OPTIMIZERS))
@pytest.mark.parametrize("how", ["trainer", "to_device"])
def test_trainer_on_cpu_is_bitwise_the_plain_loop(cpu, how, opt_name):
    want = scenarios.plain_loop("eager", opt_name)
    assert torch.equal(scenarios.plain_loop(how, opt_name), want)
    assert want[-1] < want[0]


def test_fsdp_in_one_cpu_process_runs_as_ddp_and_says_so_once(cpu, caplog):
    want = scenarios.plain_loop("eager", "adamw")
    with caplog.at_level(logging.INFO, logger="seamless_tpu"):
        got = scenarios.plain_loop("trainer", "adamw", strategy="fsdp")
        scenarios.plain_loop("trainer", "adamw", strategy="fsdp")
        model = torch.nn.Linear(2, 2)
        trainer = st.SeamlessTPUTrainer(model, strategy="fsdp")
    assert torch.equal(got, want)
    assert trainer.model is model and trainer.strategy == "fsdp" and trainer.mesh is None, "the model itself, unwrapped"
    said = [r.getMessage() for r in caplog.records if "nothing to shard" in r.getMessage()]
    assert said == ["seamless_tpu: strategy='fsdp' on one cpu process has nothing to shard over; running as 'ddp'"]


def test_trainer_cpu_extras(cpu, tmp_path):
    model = scenarios.mlp()
    trainer = st.SeamlessTPUTrainer(model, precision="bf16")
    assert trainer.model is model and trainer.device == torch.device("cpu") and trainer.mesh is None
    with trainer.autocast():
        assert model(torch.ones(2, 10)).dtype == torch.bfloat16
    with st.SeamlessTPUTrainer(model).autocast():
        assert model(torch.ones(2, 10)).dtype == torch.float32
    assert trainer.compile_stats() == {
        "compiles": 0,
        "cached_compiles": 0,
        "executions": 0,
        "persistent_cache_hits": 0,
        "persistent_cache_misses": 0,
        "persistent_cache_failures": 0,
        "device_to_host_transfers": 0,
    }
    optimizer = torch.optim.Adam(model.parameters())
    path = trainer.save({"model": model, "optimizer": optimizer}, tmp_path / "ckpt.pt")
    loaded = torch.load(path)
    assert torch.equal(loaded["model"]["0.weight"], model[0].weight) and "param_groups" in loaded["optimizer"]
    loader = trainer.prepare_data_loader(torch.utils.data.DataLoader(scenarios._Pairs(10), batch_size=4))
    assert [len(b[0]) for b in loader] == [4, 4, 2], "off XLA the last batch is kept unless asked"
    with pytest.raises(ValueError, match=r"precision must be one of \(None, 'fp32', 'bf16'\), got 'fp16'"):
        st.SeamlessTPUTrainer(model, precision="fp16")
    with pytest.raises(
        ValueError,
        match=r"apply to XLA devices, or to several torch.distributed ranks, but the device is cpu in one process",
    ):
        st.SeamlessTPUTrainer(model, xla_spmd_config={"mesh_shape": [1]})


# --- checkpoints: atomic, the same outcome on every rank, the model's own keys --------------------


def test_async_checkpoint_saves_the_state_at_the_call_while_training_goes_on(tmp_path, cpu):
    """save_checkpoint(..., blocking=False) returns a Future at once; the loop trains while the write is
    held back; what lands on disk is the state at the call (weights, Adam state, a plain value mutated
    after it); the next save waits for the one in flight."""
    model = scenarios.mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    x, y = torch.randn(8, 10), torch.randn(8, 1)
    scenarios.run_steps(model, optimizer, x, y, 2)
    gate = threading.Event()
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    adam_at_call = optimizer.state[model[0].weight]["exp_avg"].clone()
    meta = {"seen": [1, 2]}
    with faults.held_commit(gate):
        future = trainer.save_checkpoint(tmp_path / "ckpt", blocking=False, model=model, optimizer=optimizer, meta=meta)
        assert isinstance(future, concurrent.futures.Future)
        meta["seen"].append(3)
        scenarios.run_steps(model, optimizer, x, y, 3)  # training goes on while the write waits
        assert not future.done() and not (tmp_path / "ckpt" / "LATEST").exists()
        threading.Timer(0.5, gate.set).start()
        trainer.save_checkpoint(tmp_path / "ckpt2", model=model)  # waits for the one in flight first
        assert future.done() and future.result() == str(tmp_path / "ckpt")
    fresh = scenarios.mlp(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert trainer.load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=fresh_opt) == {"meta": {"seen": [1, 2]}}
    assert all(torch.equal(v, at_call[k]) for k, v in fresh.state_dict().items())
    assert not torch.equal(model[0].weight, at_call["0.weight"]), "the loop did train meanwhile"
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], adam_at_call)


def test_async_staging_buffers_are_one_set_reused_while_the_tensors_keep_their_shapes_and_dtypes(cpu):
    """The CUDA asynchronous save's host buffers (_Staging, pinned there): the same set for a save of the same
    shapes and dtypes (host memory stays one copy of the state), a new set, the old one dropped, when any differs
    (optimizer state that appeared, a dtype change). The copies themselves run in the gpu tier."""
    made = []

    def alloc(shape, dtype):
        made.append((shape, dtype))
        return torch.empty(shape, dtype=dtype)

    model_only = [((4, 3), torch.float32), ((4,), torch.float32)]
    with_adam = model_only + [((4, 3), torch.float32), ((4, 3), torch.float32), ((), torch.float32)]
    first = st._staging_buffers([], model_only, alloc)
    assert st._staging_buffers(first, model_only, alloc) is first and made == model_only, "reused, nothing made"
    second = st._staging_buffers(first, with_adam, alloc)
    assert [(tuple(b.shape), b.dtype) for b in second] == with_adam and first == [], "the old set is dropped"
    third = st._staging_buffers(second, [((4, 3), torch.bfloat16)] + with_adam[1:], alloc)
    assert third is not second and third[0].dtype == torch.bfloat16 and len(made) == 2 + 5 + 5
    assert st._staging_buffers(third, [((4, 3), torch.bfloat16)] + with_adam[1:], alloc) is third


def test_async_checkpoint_failure_raises_from_its_future_or_else_the_next_call(tmp_path, cpu):
    model = torch.nn.Linear(3, 2)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    trainer.save_checkpoint(tmp_path, model=model, epoch=1)

    with faults.failing_commit(OSError(28, "No space left on device")):
        future = trainer.save_checkpoint(tmp_path, blocking=False, model=model, epoch=2)
        with pytest.raises(OSError, match="No space left on device"):
            future.result(timeout=60)
        assert trainer.load_checkpoint(tmp_path, model=model) == {"epoch": 1}, "the previous checkpoint stays"
        trainer.save_checkpoint(tmp_path, blocking=False, model=model, epoch=3)  # nobody asks this one's Future
        with pytest.raises(OSError, match="No space left on device"):
            trainer.save_checkpoint(tmp_path, model=model, epoch=4)


def test_rolling_history_keeps_the_last_k_and_each_loads(tmp_path, cpu):
    model = torch.nn.Linear(3, 2)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    for epoch in range(4):
        with torch.no_grad():
            model.weight.fill_(epoch)
        trainer.save_checkpoint(tmp_path, keep_last=2, model=model, epoch=epoch)
    kept = (tmp_path / "HISTORY").read_text().split()
    assert len(kept) == 2 and sorted(n for n in os.listdir(tmp_path) if n.startswith("save-")) == sorted(kept)
    assert (tmp_path / "LATEST").read_text() == kept[-1]
    assert trainer.load_checkpoint(tmp_path, model=model) == {"epoch": 3}, "resume from the newest"
    assert trainer.load_checkpoint(tmp_path / kept[0], model=model) == {"epoch": 2}
    assert torch.equal(model.weight, torch.full((2, 3), 2.0))
    trainer.save_checkpoint(tmp_path, model=model, epoch=4)  # keep_last=1 again: only the new one stays
    assert len([n for n in os.listdir(tmp_path) if n.startswith("save-")]) == 1
    with pytest.raises(ValueError, match="at least 1; got 0"):
        trainer.save_checkpoint(tmp_path, keep_last=0, model=model)


def test_checkpoint_bad_input_names_the_key_or_path(tmp_path, cpu):
    model = scenarios.mlp()
    optimizer = torch.optim.Adam(model.parameters())
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    trainer.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=optimizer, epoch=1)
    with pytest.raises(FileNotFoundError, match=r"is not a seamless_tpu checkpoint: it has no LATEST file"):
        trainer.load_checkpoint(tmp_path, model=model)
    with pytest.raises(KeyError, match=r"has no 'net'; it holds \['model', 'optimizer'\]"):
        trainer.load_checkpoint(tmp_path / "ckpt", net=model)
    with pytest.raises(KeyError, match=r"missing keys \['bias', 'weight'\], unexpected keys \['0.bias'"):
        trainer.load_checkpoint(tmp_path / "ckpt", model=torch.nn.Linear(10, 32))
    wider = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.ReLU(), torch.nn.Linear(33, 1))
    with pytest.raises(
        ValueError, match=r"'0.weight' has shape \(32, 10\) in the checkpoint and \(33, 10\) in the model"
    ):
        trainer.load_checkpoint(tmp_path / "ckpt", model=wider)
    with pytest.raises(TypeError, match=r"'epoch' is a int. Plain values come back from the call"):
        trainer.load_checkpoint(tmp_path / "ckpt", model=model, epoch=0)
    with pytest.raises(ValueError, match=r"save_checkpoint needs something to save"):
        trainer.save_checkpoint(tmp_path / "other")
    merged = st.consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "plain.pt")
    assert sorted(merged["model"]) == sorted(model.state_dict()) and merged["epoch"] == 1
    assert torch.equal(torch.load(tmp_path / "plain.pt")["model"]["0.weight"], model[0].weight)


class Counter:
    """A user object with the state_dict()/load_state_dict() pair, like a stateful sampler."""

    def __init__(self):
        self.seen, self.weights = 0, torch.zeros(2)

    def state_dict(self):
        return {"seen": self.seen, "weights": self.weights.clone()}

    def load_state_dict(self, state):
        self.seen, self.weights = state["seen"], state["weights"]


def stateful_kit(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, optimizer, scheduler, scaler, Counter()


@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam_before_first_step"])
def test_checkpoint_of_an_optimizer_without_state_loads(tmp_path, cpu, optimizer_kind):
    """torch.distributed.checkpoint drops an empty 'state': plain SGD, or any optimizer saved before its
    first step, loaded with KeyError: 'state' from inside torch."""
    model = torch.nn.Linear(3, 2)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adam_before_first_step": lambda p: torch.optim.Adam(p, lr=0.1),
    }[optimizer_kind]
    optimizer = make(model.parameters())
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    if optimizer_kind == "sgd":
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    trainer.save_checkpoint(tmp_path, model=model, optimizer=optimizer)
    other = make(model.parameters())
    trainer.load_checkpoint(tmp_path, optimizer=other)
    assert other.state_dict() == optimizer.state_dict()


def test_checkpoint_restores_any_stateful_object_in_place(tmp_path, cpu):
    """A scheduler, a GradScaler and a user object are saved by their state_dict and restored in place
    (Fabric's semantics); a scheduler is never pickled whole with its optimizer and parameters."""
    model, optimizer, scheduler, scaler, counter = stateful_kit(0)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    scaler.scale(torch.ones(()))  # the scaler's state starts at its first scale()
    scaler.update(512.0)
    counter.seen, counter.weights = 7, torch.tensor([1.0, 2.0])
    trainer.save_checkpoint(
        tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, counter=counter, epoch=3
    )
    model2, optimizer2, scheduler2, scaler2, counter2 = stateful_kit(1)
    plain = trainer.load_checkpoint(
        tmp_path, model=model2, optimizer=optimizer2, scheduler=scheduler2, scaler=scaler2, counter=counter2
    )
    assert plain == {"epoch": 3}
    assert scheduler2.state_dict() == scheduler.state_dict() and optimizer2.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    assert (
        scaler2.get_scale() == 512.0 and counter2.seen == 7 and torch.equal(counter2.weights, torch.tensor([1.0, 2.0]))
    )
    assert torch.equal(model2.weight, model.weight)
    merged = st.consolidate_checkpoint(tmp_path)
    assert merged["scheduler"] == scheduler.state_dict() and merged["counter"]["seen"] == 7
    # trainer.save too: the scheduler's state_dict, not the scheduler with its optimizer inside
    saved = torch.load(trainer.save({"scheduler": scheduler}, tmp_path / "one.pt"), weights_only=False)
    assert saved == {"scheduler": scheduler.state_dict()}


@pytest.mark.parametrize("value,where", [
    (lambda m, o: {"models": {"net": m}}, r"models\['net'\] is a Linear"),
    (lambda m, o: {"opts": [o]}, r"opts\[0\] is a SGD"),
])
def test_checkpoint_refuses_state_inside_a_plain_value_at_save_time(tmp_path, cpu, value, where):
    model, optimizer, *_ = stateful_kit(0)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    with pytest.raises(TypeError, match=where + r" inside a plain value; pass it as its own keyword"):
        trainer.save_checkpoint(tmp_path / "ckpt", **value(model, optimizer))
    assert not (tmp_path / "ckpt").exists(), "refused before anything is written"


def test_save_checkpoint_removes_only_what_it_wrote(tmp_path, cpu):
    """A user's step-5000/ export, and any folder named like ours that a save did not create, survive."""
    model = torch.nn.Linear(3, 2)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    for name in ("step-5000", "save-1-2", "step-3-4"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights.bin").write_bytes(b"user data")
    trainer.save_checkpoint(tmp_path, model=model, epoch=1)
    first = (tmp_path / "LATEST").read_text()
    trainer.save_checkpoint(tmp_path, model=model, epoch=2)
    left = sorted(os.listdir(tmp_path))
    assert first not in left, "our previous attempt is removed"
    assert left == sorted(
        ["HISTORY", "LATEST", (tmp_path / "LATEST").read_text(), "save-1-2", "step-3-4", "step-5000"]
    ), left


def test_failed_checkpoint_write_raises_an_ordinary_exception_naming_the_path(tmp_path, cpu, monkeypatch):
    """A full disk inside torch.distributed.checkpoint raises CheckpointException, a BaseException that
    `except Exception` misses; the user gets an OSError naming the path and the cause. Nothing is lost."""
    model = torch.nn.Linear(3, 2)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    trainer.save_checkpoint(tmp_path, model=model, epoch=1)

    def disk_full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", disk_full)
    try:
        trainer.save_checkpoint(tmp_path, model=model, epoch=2)
    except Exception as e:  # noqa: BLE001 (the point: an ordinary exception)
        error = e
    else:
        raise AssertionError("a save onto a full disk raised nothing")
    monkeypatch.undo()
    assert isinstance(error, OSError) and "could not write the checkpoint" in str(error) and str(tmp_path) in str(error)
    assert "No space left on device" in str(error) and "Traceback" not in str(error)
    assert trainer.load_checkpoint(tmp_path, model=model) == {"epoch": 1}, (
        "the previous checkpoint is still the one loaded"
    )


class CompileCounter:
    """torch_xla.debug.metrics as the watchdog reads it: a compile count the test drives."""

    def __init__(self):
        self.compiles, self.on_cpu = 0, []  # on_cpu: the ops torch_xla ran on the CPU (its "aten::" counters)
        self.unreadable = 0  # executables the persistent cache failed to read back

    def counter_value(self, name):
        return {"UncachedCompile": self.compiles, "PersistentCacheDeserializeFailure": self.unreadable}.get(name, 0)

    def counter_names(self):
        return ["UncachedCompile", "xla::add", *self.on_cpu]


def watched_steps(watchdog, met, optimizer, compiles_at, steps):
    for step in range(steps):
        watchdog.before_step(met)
        met.compiles += step in compiles_at
        watchdog.after_step(optimizer, st._record(optimizer), met)


@pytest.mark.parametrize("unfreeze", [True, False], ids=["add_param_group", "same_groups"])
def test_watchdog_restarts_warm_up_for_a_new_parameter_group(fresh, caplog, unfreeze):
    """Progressive unfreezing compiles a new graph once and then stays flat: no warning. The same
    compiles with no new group are late ones, and warn."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    watchdog, met = st._CompileWatchdog(), CompileCounter()
    with caplog.at_level(logging.WARNING, logger="seamless_tpu"):
        watched_steps(watchdog, met, optimizer, {0, 1}, 6)
        if unfreeze:
            optimizer.add_param_group({"params": model[1].parameters()})
        for _ in range(st.LATE_COMPILES_TO_WARN):  # each unfreeze (or not) recompiles twice, then flat
            watched_steps(watchdog, met, optimizer, {0, 1}, 6)
            if unfreeze:
                optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    warned = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert len(warned) == (0 if unfreeze else 1), warned


def test_watchdog_names_each_op_torch_xla_ran_on_the_cpu_once(fresh, caplog):
    """An aten:: counter (torch_xla's CPU fallback) met at a cut is named in one warning; the same op later is not
    named again, a new one is."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    watchdog, met = st._CompileWatchdog(), CompileCounter()
    with caplog.at_level(logging.WARNING, logger="seamless_tpu"):
        watched_steps(watchdog, met, optimizer, {0}, 2)
        met.on_cpu += ["aten::glu_backward", "aten::_ctc_loss.Tensor"]
        watched_steps(watchdog, met, optimizer, {0}, 3)
        met.on_cpu.append("aten::median.dim_values")
        watched_steps(watchdog, met, optimizer, set(), 3)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert warned[0].startswith("seamless_tpu: torch_xla ran aten::_ctc_loss.Tensor, aten::glu_backward on the CPU"
                                " (no XLA lowering in torch_xla "), warned[0]
    assert "copies its inputs to the host and its result back" in warned[0] and "PT_XLA_DEBUG_LEVEL=1" in warned[0]
    assert warned[1].startswith("seamless_tpu: torch_xla ran aten::median.dim_values on the CPU"), warned[1]


def test_watchdog_warns_once_when_the_compile_cache_cannot_be_read_back(fresh, caplog, monkeypatch):
    """torch_xla 2.9 on TPU writes its persistent cache and fails to read each executable back (pytorch/xla#9094):
    the first cut that sees a failure warns once, with the issue, the fix and how to stop the writes; a later failure
    adds nothing. The real twin: test_real_xla's test_xla_cpu_writes_a_compile_cache_it_cannot_read_back."""
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", "/cache/v5e-host")
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    watchdog, met = st._CompileWatchdog(), CompileCounter()
    with caplog.at_level(logging.WARNING, logger="seamless_tpu"):
        watched_steps(watchdog, met, optimizer, {0}, 2)
        assert caplog.records == []
        met.unreadable = 2
        watched_steps(watchdog, met, optimizer, set(), 2)
        met.unreadable = 5
        watched_steps(watchdog, met, optimizer, set(), 2)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert warned[0].startswith("seamless_tpu: torch_xla ") and "(/cache/v5e-host)" in warned[0]
    for said in ("a restart costs the whole first-run compile", "pytorch/xla#9094", "pytorch/xla#9759",
                 "SEAMLESS_TPU_COMPILE_CACHE=off"):
        assert said in warned[0], (said, warned[0])


def test_watchdog_does_not_name_a_read_to_the_host_as_an_op_run_on_the_cpu(fresh, caplog):
    """.item(), float(t), bool(t) (aten::_local_scalar_dense, as measured on torch_xla 2.9) read a value to the host:
    the transfer is counted, nothing lacks a lowering, so a loop that logs loss.item() each step is not warned; an op
    with no lowering met at the same cut still is."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    watchdog, met = st._CompileWatchdog(), CompileCounter()
    with caplog.at_level(logging.WARNING, logger="seamless_tpu"):
        watched_steps(watchdog, met, optimizer, {0}, 2)
        met.on_cpu.append("aten::_local_scalar_dense")
        watched_steps(watchdog, met, optimizer, set(), 3)
        assert caplog.records == [], [r.getMessage() for r in caplog.records]
        met.on_cpu.append("aten::median.dim_values")
        watched_steps(watchdog, met, optimizer, set(), 2)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith("seamless_tpu: torch_xla ran aten::median.dim_values on the CPU ("
                                                     ), warned
    assert "_local_scalar_dense" not in warned[0], warned


def test_watchdog_names_lbfgs_history_as_the_recompile_cause(fresh, caplog):
    """LBFGS compiles new graphs each step until its history is full; the warning says so."""
    optimizer = torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters(), history_size=100)
    with caplog.at_level(logging.WARNING, logger="seamless_tpu"):
        watched_steps(st._CompileWatchdog(), CompileCounter(), optimizer, set(range(10)), 10)
    warned = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert len(warned) == 1 and "until its history is full (history_size=100)" in warned[0], warned


# The cuts of tests/loops.py's epoch loops (3 steps an epoch, an eval pass after each) as real XLA
# measured them: "d1" is a step of optimizer d that compiled one graph, "E0" a forward cut after a
# no-grad pass that compiled none ("T": after a backward). tests/test_real_xla.py runs the loops.
MEASURED_CUTS = {
    "gan_eval": "d1 g1 d1 g1 d0 g0 E1 d1 g0 d0 g0 d0 g0 E0 d0 g0 d0 g0 d0 g0 E0 d0 g0 d0 g0 d0 g0 E0 d0 g0 d0 g0",
    # G's EMA evaluated (no forward cuts it: it joins D's next step), its score summed over epochs: D's
    # steps 3 (EMA inputs replicated), 4 (the eval joins) and 7 (the sum) compile once each
    "gan_eval ema": "d1 g1 d1 g1 d1 g0 d1 g0 d0 g0 d0 g0 d1 g0 d0 g0 d0 g0 d0 g0 d0 g0 d0 g0 d0 g0 d0 g0",
    "gan_eval two": "T1 d1 g1 T1 d1 g1 T0 d0 g0 E1 E1 T0 d0 g0 T0 d0 g0 T0 d0 g0 E0 E0 T0 d0 g0 T0 d0 g0 T0 d0 g0 "
                    "E0 E0 T0 d0 g0 T0 d0 g0 T0 d0 g0 E0 E0 T0 d0 g0",
    # the EMA copy's inputs are replicated only after its first update: step 3 is a graph of its own
    "ema_eval": "s1 s1 s1 E1 s1 s0 s0 E0 s0 s0 s0 E0 s0 s0 s0 E0 s0 s0 s0",
    "distill_eval": "s1 s1 s0 E1 s1 s0 s0 E0 s0 s0 s0 E0 s0 s0 s0 E0 s0 s0 s0",
    "distill_eval grow": "s1 s1 s1 E1 s1 s1 s1 E1 s1 s1 s1 E1 s1 s1 s1 E1 s1 s1 s1",  # a new batch size each step
}


def replay_cuts(watchdog, met, cuts):
    """Drive the watchdog through MEASURED_CUTS-style cuts: the steps of optimizers d, g and s, and the
    forward cuts of one model."""
    model = torch.nn.Linear(2, 2)
    optimizers = {name: torch.optim.Adam(model.parameters()) for name in "dgs"}
    for cut in cuts.split():
        name, compiled = cut[0], int(cut[1:])
        if name in optimizers:
            watchdog.before_step(met)
            met.compiles += compiled
            watchdog.after_step(optimizers[name], st._record(optimizers[name]), met)
        else:
            met.compiles += compiled
            watchdog.after_forward_cut((id(model), "eval" if name == "E" else "train"), met)


@pytest.mark.parametrize("loop", list(MEASURED_CUTS))
def test_watchdog_warns_only_when_graphs_keep_changing_over_epochs(fresh, caplog, loop):
    """A loop with an eval pass each epoch (a GAN's two optimizers, an EMA, distillation) meets new
    graphs once, after its first eval pass, long after step 2: no warning. Counted per optimizer, the
    EMA loops warned at step 4 (issue 25). A new batch size every step still warns, once."""
    with caplog.at_level(logging.WARNING, logger="seamless_tpu"):
        replay_cuts(st._CompileWatchdog(), CompileCounter(), MEASURED_CUTS[loop])
    warned = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert len(warned) == ("grow" in loop), warned


def test_failed_save_keeps_the_previous_file_and_leaves_no_temp(tmp_path, cpu):
    trainer = st.SeamlessTPUTrainer(torch.nn.Linear(3, 2), device="cpu")
    path = trainer.save({"step": 1}, tmp_path / "ckpt.pt")
    with pytest.raises((AttributeError, TypeError, __import__("pickle").PicklingError), match=r"(?i)pickle"):
        trainer.save({"step": 2, "fn": lambda: 0}, path)
    assert torch.load(path) == {"step": 1} and sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    with pytest.raises(FileNotFoundError, match=r"the directory .*missing.* does not exist; create it first"):
        trainer.save({"step": 2}, tmp_path / "missing" / "ckpt.pt")


def test_save_unwraps_torch_compile(tmp_path, cpu, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch.compile writes it otherwise
    model = scenarios.mlp()
    want = sorted(model.state_dict())
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    compiled = torch.compile(model)  # building it compiles nothing
    assert sorted(torch.load(trainer.save({"m": compiled}, tmp_path / "a.pt"))["m"]) == want
    model[0] = torch.compile(model[0])  # a submodule compiled on its own
    assert sorted(torch.load(trainer.save(model, tmp_path / "b.pt"))) == want
    plain = scenarios.mlp(seed=1)
    plain.load_state_dict(torch.load(tmp_path / "b.pt"))


def test_concurrent_first_use_activates_once(fake):
    """8 threads reaching XLA first at once install one pair of optimizer hooks: two syncs per step (the forward and
    backward's graph, then the step's)."""
    import threading

    barrier = threading.Barrier(8)
    errors = []

    def first_use():
        try:
            barrier.wait()
            st.to_device(torch.ones(4, 2))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(st._STATE.optimizer_hooks) == 2
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    st.SeamlessTPUTrainer(model)
    before = sum(e == ("sync",) for e in fake.events)
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    assert sum(e == ("sync",) for e in fake.events) == before + 2


def test_special_scalars_are_off_only_while_a_step_runs(fake):
    """torch_xla's special scalars (0 and 1 as graph constants) are off inside an XLA optimizer step, so a scalar that
    is 1 at step 1 only (Adafactor's weight) is an input as at later steps (tests/first_step.py, real torch_xla:
    Adafactor compiles once). After the step they are as the user had them: on, or off if the user turned them off;
    after a step that raised, from the next forward of a trainer's model; after _reset_caches."""
    model, seen = torch.nn.Linear(2, 1), []

    class Seen(torch.optim.SGD):  # torch wraps a subclass's step too: the global hooks run
        def step(self, closure=None):
            seen.append(fake.special_scalars)
            if len(seen) == 2:
                raise RuntimeError("a step that raised")

    optimizer = Seen(model.parameters(), lr=0.1)
    x = st.SeamlessTPUTrainer(model).to_device(torch.ones(4, 2))
    model(x).sum().backward()
    optimizer.step()
    assert seen == [False] and fake.special_scalars is True
    with pytest.raises(RuntimeError, match="a step that raised"):
        optimizer.step()
    assert seen == [False, False] and fake.special_scalars is False
    model(x)
    assert fake.special_scalars is True
    fake.special_scalars = False  # the user's choice
    optimizer.step()
    assert seen == [False, False, False] and fake.special_scalars is False
    fake.special_scalars, st._STATE.cuts.scalars = False, True  # as inside a step
    st._reset_caches()
    assert fake.special_scalars is True


@pytest.mark.parametrize("untested, opted_in, runs", [((), False, True), (("torch 2.10.0",), False, False),
                                                      (("torch_xla 2.10.0+git", "torch 2.10.0"), True, True)])
def test_on_untested_versions_what_rests_on_private_apis_runs_only_when_asked(fake, monkeypatch, untested, opted_in,
                                                                             runs):
    """Issue 62's version gate: on torch and torch_xla as tested (_TESTED_WITH), the trainer runs repeated blocks as
    one loop and turns torch_xla's special scalars off in a step, and says nothing. On other versions it warns once,
    naming them, and runs neither, where a patch release can move the private APIs they call, unless
    SEAMLESS_TPU_UNTESTED=1 (then it warns it runs them anyway). Its real twin: the tested versions, every xla tier."""
    import block_loops

    monkeypatch.setattr(st, "_untested", lambda: untested)
    if opted_in:
        monkeypatch.setenv("SEAMLESS_TPU_UNTESTED", "1")
    seen = []

    class Seen(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(fake.special_scalars)

    with pytest.warns() if untested else contextlib.nullcontext() as caught:
        models = [block_loops.Stack(), block_loops.Stack()]
        for model in models:  # a second trainer says nothing more
            st.SeamlessTPUTrainer(model)
        Seen(models[0].parameters(), lr=0.1).step()
    said = [str(w.message) for w in caught or () if "seamless_tpu was tested with" in str(w.message)]
    assert len(said) == bool(untested) and all(v in said[0] for v in untested), said
    assert not untested or ("running what rests on their private APIs anyway" if opted_in else
                            "repeated blocks run one by one") in said[0], said
    assert all((m.layers in st._STATE.loops.stacks) == runs for m in models)
    assert seen == [not runs], "special scalars are off in a step only where the step's scalars run"


# --- strategy="fsdp": errors and resharding -------------------------------------------------------


def test_fsdp_errors(fake):
    with pytest.raises(ValueError, match=r"strategy must be one of \('ddp', 'fsdp'\), got 'zero3'"):
        st.mesh_shape_for(4, strategy="zero3")
    with pytest.raises(ValueError, match=r"strategy must be one of .*got 'FSDP'"):
        st.SeamlessTPUTrainer(torch.nn.Linear(2, 2), strategy="FSDP")
    with pytest.raises(ValueError, match=r"axis named 'fsdp', but xla_spmd_config has axes \('data', 'model'\)"):
        st.SeamlessTPUTrainer(
            torch.nn.Linear(2, 2),
            strategy="fsdp",
            xla_spmd_config={"mesh_shape": [2, 2], "axis_names": ["data", "model"]},
        )
    mesh = st.create_xla_mesh()  # ("data",): no fsdp axis
    with pytest.raises(ValueError, match=r"but the mesh passed as mesh= has axes \('data',\); name one axis 'fsdp'"):
        st.SeamlessTPUTrainer(torch.nn.Linear(2, 2), strategy="fsdp", mesh=mesh)


def test_resharding_waits_for_data_a_running_step_still_computes(fake, monkeypatch):
    """tests/scenarios.py reshards_what_a_running_step_still_computes proves the race on torch_xla;
    here the fsdp and tensor-parallel trainers, which reshard parameters and optimizer state that
    already live on XLA, wait once and annotate again, and any other torch_xla error is left alone.
    (The fake's XLA tensors live on the CPU, so its to_device sends them from the host instead.)"""
    for how in ("fsdp", "tp"):
        model = scenarios.mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.nn.functional.mse_loss(model(torch.ones(4, 10)), torch.ones(4, 1)).backward()
        optimizer.step()
        moment = optimizer.state[model[0].weight]["momentum_buffer"]
        fake.running.update(id(t) for t in [*model.parameters(), moment])
        fake.events.clear()
        if how == "fsdp":
            st.SeamlessTPUTrainer(model, optimizer, strategy="fsdp")
            assert fake.shardings[moment] == fake.shardings[model[0].weight] == "{devices=[4,1]0,1,2,3}"
        else:
            st.SeamlessTPUTrainer(
                model, optimizer, xla_spmd_config={"model_parallel_size": 2}, tp_plan=scenarios.MLP_PLAN
            )
            assert (
                fake.shardings[moment]
                == fake.shardings[model[0].weight]
                == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
            )
        assert fake.events.count(("wait_device_ops",)) == 1, (how, fake.events)
    broken = RuntimeError("Check failed: mesh mismatch")
    monkeypatch.setattr(fake.modules["torch_xla"]._XLAC, "_xla_mark_sharding", lambda *a: (_ for _ in ()).throw(broken))
    with pytest.raises(RuntimeError) as raised:
        st.SeamlessTPUTrainer(torch.nn.Linear(4, 4), strategy="fsdp")
    assert raised.value is broken

def test_the_graph_is_cut_where_an_iteration_of_any_loop_ends(fake):
    """tests/test_real_xla.py proves the graph counts and losses on torch_xla; here, where each cut
    falls. A forward cuts the graph when a backward or a no-grad forward came since the last cut; an
    optimizer step cuts before and after it runs (the forward and backward one graph, the step
    another); a closure is cut before and after it runs."""
    model = scenarios.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = st.SeamlessTPUTrainer(model)
    x, y = trainer.to_device(*scenarios.data(8))

    def cuts(loop):
        fake.events.clear()
        loop()
        return fake.events.count(("sync",))

    def step(k=1, forwards=1):
        optimizer.zero_grad()
        for _ in range(k):
            sum(torch.nn.functional.mse_loss(model(x), y) for _ in range(forwards)).backward()
        optimizer.step()

    assert cuts(lambda: [step() for _ in range(3)]) == 3 * 2, "the plain loop: before and after each step"
    assert cuts(lambda: [step(forwards=2) for _ in range(3)]) == 3 * 2, "two forwards in one iteration stay one graph"
    assert cuts(lambda: [step(k=3) for _ in range(2)]) == 2 * 4, (
        "per step: 2 forwards after a backward, then before and after the step"
    )

    def by_hand():
        for _ in range(3):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)

    assert cuts(by_hand) == 2, "each forward after a backward (the step before left nothing pending)"

    def evaluate():
        with torch.no_grad():
            for _ in range(3):
                model(x)
        model(x)  # training again

    assert cuts(evaluate) == 1 + 2 + 1, "the last update by hand, each later no-grad forward, and the switch back"

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        fake.events.append(("closure ran",))
        return loss

    lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=3, history_size=1)
    fake.events.clear()
    lbfgs.step(closure)
    optimizer.step(closure=closure)
    order = "".join({("sync",): "|", ("closure ran",): "C"}.get(e, "") for e in fake.events)
    # each step: a cut before it, one around each closure (LBFGS's 3: its reads then find the
    # gradients computed), and the step's own
    assert order == "|" + "|C|" * 3 + "|" + "|" + "|C|" + "|", order

def test_fsdp_shards_every_parameter_on_one_dimension(fake):
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
    trainer = st.SeamlessTPUTrainer(model, strategy="fsdp")
    assert (tuple(trainer.mesh.mesh_shape), tuple(trainer.mesh.axis_names)) == ((4,), ("fsdp",))
    specs = {name: fake.shardings.get(p) for name, p in model.named_parameters()}
    # The largest dimension that splits evenly over 4; the 6-row weight shards its 32 columns.
    assert specs == {"0.weight": "{devices=[4,1]0,1,2,3}", "0.bias": "{devices=[4]0,1,2,3}",
                     "2.weight": "{devices=[1,4]0,1,2,3}", "2.bias": "{devices=[4]0,1,2,3}"}
    x = trainer.to_device(torch.ones(8, 10))
    assert fake.shardings[x] == "{devices=[4,1]0,1,2,3}", "the batch goes over every axis"


def test_fsdp_spec_picks_one_dimension():
    mesh = types.SimpleNamespace(axis_names=("fsdp",), mesh_shape=(4,))
    layout = st._Layout("xla", torch.device("cpu"), "fsdp", mesh)

    def spec(*shape):
        return layout.spec(torch.empty(shape))
    assert spec(6, 32) == (None, "fsdp")
    assert spec(256, 64) == ("fsdp", None)
    assert spec(6, 3) == ("fsdp", None), "nothing splits evenly: the largest, padded by XLA"
    assert spec() == ()
    assert st._Layout("xla", torch.device("cpu"), "ddp", mesh).spec(torch.empty(6, 32)) == (None, None)


# --- the example's command line ------------------------------------------------------------------

BAD_EXAMPLE_ARGS = [
    (["--tpu", "--device", "cpu"], "--tpu and --device cpu ask for two devices"),
    (["--num-workers", "3"], "--num-workers needs --ray"),
    (["--epochs", "0"], "argument --epochs: must be positive, got 0"),
    (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
    (["--samples", "10"], "--samples 10 gives no full batch of --batch-size 64"),
    (["--device", "tpuu"], "argument --device: invalid choice: 'tpuu'"),
    (["--tpu"], "device 'tpu' was requested but no TPU chip is visible"),
]


@pytest.mark.parametrize("argv,text", BAD_EXAMPLE_ARGS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_example_usage_errors_are_one_line_and_status_2(argv, text, capsys, fresh, monkeypatch):
    import example_train

    monkeypatch.setattr(st, "_tpu_chip_count", lambda: 0)
    with pytest.raises(SystemExit) as exit_info:
        example_train.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("example_train.py: error: ") and text in err, err


# --- the trainer on the fake torch_xla: the twins of tests/test_real_xla.py ----------------------


@pytest.mark.parametrize("scenario", scenarios.TWINS, ids=lambda f: f.__name__)
def test_fake_xla_twin(fake, scenario):
    if scenario is scenarios.tensor_before_spmd_is_refused:
        scenario(make_early_tensor=fake.make_early_tensor)
    else:
        scenario()


def test_fake_xla_spmd_precedes_every_transfer(fake):
    trainer = st.SeamlessTPUTrainer(scenarios.mlp())
    trainer.to_device(torch.ones(4, 10))
    kinds = [e[0] for e in fake.events]
    assert kinds.index("use_spmd") < kinds.index("send")


def test_fake_sharding_text_matches_xla_format(fake):
    mesh = sys.modules["torch_xla.distributed.spmd"].Mesh(list(range(4)), (2, 2), ("data", "model"))
    assert fake._sharding_text(mesh, (("data", "model"), None)) == scenarios.SPEC_2D
    assert fake._sharding_text(mesh, ("data", None)) == scenarios.SPEC_DATA_OF_2X2
    assert fake._sharding_text(mesh, ("model", None)) == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"


def test_fake_xla_multi_process_default_mesh_shards_batch_over_all_devices(monkeypatch, fresh):
    FakeXLA(num_devices=16, process_count=4).install(monkeypatch)
    monkeypatch.setattr(st, "_agreement_group", lambda: None)  # its 3 peers do not exist (real: test_real_xla.py)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    trainer = st.SeamlessTPUTrainer(scenarios.mlp(), device="xla")
    assert (tuple(trainer.mesh.mesh_shape), trainer.mesh.axis_names) == ((16,), ("data",)), (
        "no 'model' axis unless asked for"
    )
    x = trainer.to_device(torch.ones(16, 10))
    assert sys.modules["torch_xla"]._XLAC._get_xla_sharding_spec(x).startswith("{devices=[16,1]")


def test_fake_xla_explicit_model_axis_keeps_batch_on_data(fake):
    trainer = st.SeamlessTPUTrainer(
        scenarios.mlp(), xla_spmd_config={"data_parallel_size": 2, "model_parallel_size": 2}, tp_plan=scenarios.MLP_PLAN
    )
    assert st._STATE.batch_sharding.axes == ("data",)
    assert scenarios.sharding(trainer.to_device(torch.ones(4, 10))) == scenarios.SPEC_DATA_OF_2X2


@pytest.mark.parametrize("strategy,names", [("fsdp", ("fsdp", "model")), ("ddp", ("data", "model"))])
def test_model_parallel_size_builds_the_2d_mesh_in_one_line(fake, strategy, names):
    trainer = st.SeamlessTPUTrainer(scenarios.mlp(), strategy=strategy, xla_spmd_config={"model_parallel_size": 2},
                                    tp_plan=scenarios.MLP_PLAN)
    assert (tuple(trainer.mesh.mesh_shape), tuple(trainer.mesh.axis_names)) == ((2, 2), names)
    assert trainer.layout.batch.axes == names[:1], (
        "tensor-parallel groups get the same batch: it splits over the other axis"
    )
    split = {n for n, p in trainer.model.named_parameters() if fake.shardings.get(p) != "{replicated}"}
    # the plan's weights over 'model'; with fsdp the rest too (the 1-feature output bias: XLA pads); the rest marked
    # whole, so that step 1 reads them as step 2 will
    assert split == {"0.weight", "0.bias", "2.weight"} | ({"2.bias"} if strategy == "fsdp" else set()), split


def test_a_model_axis_without_a_plan_is_refused_before_any_work(fake):
    model = scenarios.mlp()
    with pytest.raises(
        ValueError,
        match=r"the mesh's 'model' axis has size 2, but there is no tensor-parallel plan, so the 2 "
        r"devices of each 'model' row would compute the same thing. Pass tp_plan= "
        r".* or drop the axis",
    ):
        st.SeamlessTPUTrainer(model, xla_spmd_config={"data_parallel_size": 2, "model_parallel_size": 2})
    assert model[0].weight.device.type == "cpu" and not fake.shardings.get(model[0].weight), "nothing moved or sharded"


@pytest.mark.parametrize(
    "plan,error,match",
    [
        (
            {"layers.*.fc": "colwise"},
            ValueError,
            r"tp_plan entry 'layers.\*.fc' matches no module of Sequential \(names look like \['0', '1', '2'\]",
        ),
        (
            {"0": "columnwise"},
            ValueError,
            r"tp_plan\['0'\] = 'columnwise' is not a style seamless_tpu knows; use one of",
        ),
        (
            {"1": "colwise"},
            ValueError,
            r"tp_plan splits '1' \(colwise\), a torch.nn.modules.activation.ReLU; colwise and rowwise split the "
            r"weights of torch.nn.Linear and torch.nn.Embedding modules \(or a peft tuner "
            r"layer's base_layer\) "
            r"only: leave this module out of the plan",
        ),
        (
            {"2": "colwise"},
            ValueError,
            r"tp_plan splits 2.weight \(shape \(1, 32\)\) along dim 0 over the 'model' axis of size 2, which does "
            r"not divide 1",
        ),
        (["0", "colwise"], TypeError, r"tp_plan must be a dict of module-name pattern -> style"),
    ],
)
def test_a_bad_plan_names_the_entry_before_any_work(fake, plan, error, match):
    with pytest.raises(error, match=match):
        st.SeamlessTPUTrainer(scenarios.mlp(), xla_spmd_config={"model_parallel_size": 2}, tp_plan=plan)


def test_a_plan_needs_a_model_axis(fake):
    with pytest.raises(
        ValueError, match=r"tp_plan splits weights over a 'model' mesh axis, and this trainer's mesh has none"
    ):
        st.SeamlessTPUTrainer(scenarios.mlp(), tp_plan=scenarios.MLP_PLAN)


def test_a_plan_in_one_cpu_process_is_not_silently_ignored(no_xla):
    with pytest.raises(
        ValueError, match=r"tp_plan splits weights over a 'model' mesh axis, and this trainer's mesh has none"
    ):
        st.SeamlessTPUTrainer(scenarios.mlp(), device="cpu", tp_plan=scenarios.MLP_PLAN)
    with pytest.raises(
        ValueError,
        match=r"apply to XLA devices, or to several torch.distributed ranks, but the device is cpu in one process",
    ):
        st.SeamlessTPUTrainer(
            scenarios.mlp(), device="cpu", xla_spmd_config={"model_parallel_size": 2}, tp_plan=scenarios.MLP_PLAN
        )


def test_torch_parallel_styles_are_accepted_by_name(fake):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = scenarios.mlp()
    st.SeamlessTPUTrainer(
        model, xla_spmd_config={"model_parallel_size": 2}, tp_plan={"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    assert fake.shardings.get(model[0].weight) and fake.shardings.get(model[2].weight)


def in_order_model():
    """Standard layers built in the order they are registered (MultiheadAttention initialises its
    out_proj child, then its own weights: children first, as _materialize replays it)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(20, 16),
        torch.nn.LayerNorm(16),
        torch.nn.MultiheadAttention(16, 2, batch_first=True),
        torch.nn.Conv1d(4, 4, 3),
        torch.nn.BatchNorm1d(4),
        torch.nn.Linear(16, 3),
    )


def test_a_meta_model_off_xla_gets_a_cpu_builds_weights_and_keeps_its_parameter_objects(cpu):
    on_cpu = in_order_model()
    with torch.device("meta"):
        model = in_order_model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # made on the meta parameters
    untouched = torch.get_rng_state()
    st.SeamlessTPUTrainer(model, device="cpu")
    assert torch.equal(torch.get_rng_state(), untouched), (
        "the modules drew from a copy of the RNG; the loop's is as it was"
    )
    assert all(a is b for a, b in zip(params, model.parameters()))
    for (k, v), (_, w) in zip(model.state_dict().items(), on_cpu.state_dict().items()):
        assert v.device.type == "cpu" and torch.equal(v, w), k
    model[-1](torch.ones(2, 16)).sum().backward()
    before = model[-1].weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model[-1].weight, before), "the optimizer made on meta trains the real weights"


def test_a_meta_module_without_reset_parameters_is_refused_with_the_fix(cpu):

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((3,), 2.0))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), Scaled())
    with pytest.raises(
        ValueError,
        match=r"meta tensors \['scale'\] of Scaled: it has no reset_parameters\(\).*build the model on the CPU",
    ):
        st.SeamlessTPUTrainer(model, device="cpu")


@pytest.mark.parametrize("kind", scenarios.SCALED_KINDS)
def test_a_meta_tensor_its_initialiser_leaves_unset_is_refused_at_first_use(cpu, tmp_path, kind):
    """A Linear subclass that computes `scale` in __init__ (torch.arange) and leaves it out of
    reset_parameters, built on meta: the trainer is made (a load may still fill it), then the model's
    forward, the module's own forward and a save are refused, naming the module's path and the tensor;
    the value left in place is NaN, never garbage. The real tier's twin: meta_tensor_left_unset_is_refused_or_loaded."""
    with torch.device("meta"):
        model = scenarios.scaled_net(kind)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    assert model[0].scale.isnan().all() and not model[0].weight.isnan().any()
    refusal = scenarios.UNSET_REFUSAL + (r" \(the non-persistent buffers \['scale'\] are in no checkpoint\)" if
                                         kind == "non_persistent" else "$")
    for use in (lambda: model(torch.ones(2, 10)), lambda: model[0](torch.ones(2, 10)),
                lambda: trainer.save_checkpoint(tmp_path / "ckpt", model=model)):
        with pytest.raises(ValueError, match=refusal):
            use()
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kind", scenarios.SCALED_KINDS)
def test_a_checkpoint_fills_what_a_meta_modules_initialiser_left_unset(cpu, tmp_path, kind):
    """The same model loaded from a CPU build's checkpoint after the trainer is made: every persistent
    tensor holds the checkpoint's value and the model runs as the CPU build; a non-persistent buffer is
    in no checkpoint, so it is still refused."""
    on_cpu = scenarios.scaled_net(kind, seed=1)
    st.SeamlessTPUTrainer(on_cpu, device="cpu").save_checkpoint(tmp_path, model=on_cpu)
    with torch.device("meta"):
        model = scenarios.scaled_net(kind)
    st.SeamlessTPUTrainer(model, device="cpu").load_checkpoint(tmp_path, model=model)
    x = torch.randn(3, 10)
    if kind == "non_persistent":
        with pytest.raises(ValueError, match=scenarios.UNSET_REFUSAL + ".*non-persistent buffers"):
            model(x)
        return
    assert all(torch.equal(v, on_cpu.state_dict()[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(x), on_cpu(x))


def test_a_meta_model_whose_initialisers_set_every_tensor_trains_as_its_cpu_build(cpu):
    """Scaled's reset_parameters sets `scale` too (through .data, which no version counter sees): nothing is
    refused, and 5 Adam steps give the CPU build's losses bitwise."""
    x, y = scenarios.data()
    losses = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = scenarios.scaled_net("buffer", in_reset=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        st.SeamlessTPUTrainer(model, device="cpu")
        losses.append(scenarios.run_steps(model, optimizer, x, y, 5))
    assert torch.equal(model[0].scale, torch.arange(1.0, 5))
    assert torch.equal(losses[0], losses[1]), losses


def test_a_meta_transformers_model_follows_its_own_initialisation(cpu):
    """A transformers model initialises by its _initialize_weights (normal(0, initializer_range) for
    Linear and Embedding, ones for RMSNorm, the rotary inv_freq computed), never by torch's defaults."""
    import workloads

    reference = workloads.tiny_lm("llama")
    with torch.device("meta"):
        model = workloads.tiny_lm("llama")
    st.SeamlessTPUTrainer(model, device="cpu")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, torch.nn.Linear)])
    assert abs(weights.std().item() - model.config.initializer_range) < 0.002, weights.std()
    assert all(
        torch.equal(m.weight, torch.ones_like(m.weight)) for m in model.modules() if "RMSNorm" in type(m).__name__
    )
    ids = torch.randint(0, workloads.LM_VOCAB, (2, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


class HFLike(torch.nn.Module):
    """How a transformers causal LM carries its plan: config.base_model_tp_plan for the base model under
    base_model_prefix, and the class's _tp_plan for the head (transformers 5 also merges both onto the
    instance's _tp_plan, which wins)."""

    base_model_prefix = "model"
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(base_model_tp_plan={"layers.*.up": "colwise", "layers.*.down": "rowwise"})
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(
            [torch.nn.ModuleDict({"up": torch.nn.Linear(4, 8), "down": torch.nn.Linear(8, 4)})]
        )
        self.lm_head = torch.nn.Linear(4, 6)


def test_a_transformers_model_brings_its_own_plan(fake):
    model = HFLike()
    assert st._model_tp_plan(model) == {
        "model.layers.*.up": "colwise",
        "model.layers.*.down": "rowwise",
        "lm_head": "colwise_gather_output",
    }
    model._tp_plan = {"model.layers.*.up": "colwise"}  # transformers 5: the merged plan on the instance
    assert st._model_tp_plan(model) == {"model.layers.*.up": "colwise"}
    del model._tp_plan
    st.SeamlessTPUTrainer(model, xla_spmd_config={"model_parallel_size": 2})
    assert fake.shardings.get(model.model.layers[0]["up"].weight) and fake.shardings.get(model.lm_head.weight)


@pytest.fixture(scope="module")
def peft():
    """peft, with the transformers modules it needs, imported while torch_xla is blocked: the real one writes
    PJRT_DEVICE when imported, and transformers' lazy imports fail under the fake (GenerationMixin)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "torch_xla", None)
        peft = pytest.importorskip("peft")
        import workloads

        peft.get_peft_model(workloads.tiny_lm(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    return peft


def lora_qwen3(peft, target_modules=("q_proj", "v_proj")):
    """A tiny transformers Qwen3 with peft LoRA (on q_proj and v_proj: as users fine-tune)."""
    import workloads

    return peft.get_peft_model(
        workloads.tiny_lm(),
        peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(target_modules), task_type="CAUSAL_LM"
        ),
    )


def test_a_peft_model_brings_the_plan_of_the_model_it_wraps(peft, fake):
    """The plan is the inner transformers model's, under the wrapper's path; a planned LoRA layer splits its
    base_layer as planned, and its B (colwise) or A (rowwise) as the base, so the adapters' work splits too."""
    model = lora_qwen3(peft)
    assert st._model_tp_plan(model) == {
        f"base_model.model.{k}": v for k, v in st._model_tp_plan(model.get_base_model()).items()
    }
    trainer = st.SeamlessTPUTrainer(model, xla_spmd_config={"model_parallel_size": 2})
    out, inward = (fake._sharding_text(trainer.mesh, spec) for spec in (("model", None), (None, "model")))
    attn = model.base_model.model.model.layers[0].self_attn
    for lora, spec in ((attn.q_proj, out), (attn.v_proj, out)):
        assert (
            fake.shardings.get(lora.base_layer.weight) == spec
            and fake.shardings.get(lora.lora_B["default"].weight) == spec
        )
        assert fake.shardings.get(lora.lora_A["default"].weight) == "{replicated}", (
            "A of a colwise layer reads the whole input: replicated"
        )
    assert fake.shardings.get(attn.k_proj.weight) == out and fake.shardings.get(attn.o_proj.weight) == inward


def test_a_rowwise_lora_layer_splits_its_a_as_the_base(peft, fake):
    model = lora_qwen3(peft, ["o_proj"])
    trainer = st.SeamlessTPUTrainer(model, xla_spmd_config={"model_parallel_size": 2})
    o_proj, inward = (
        model.base_model.model.model.layers[1].self_attn.o_proj,
        fake._sharding_text(trainer.mesh, (None, "model")),
    )
    assert (
        fake.shardings.get(o_proj.base_layer.weight) == inward
        and fake.shardings.get(o_proj.lora_A["default"].weight) == inward
    )
    assert fake.shardings.get(o_proj.lora_B["default"].weight) == "{replicated}"


class Linear(torch.nn.Module):
    """Not a torch.nn.Linear, though its class has the name."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))


def test_a_peft_plan_error_names_the_full_class_and_the_wrappers_path(peft, fake):
    with pytest.raises(
        ValueError,
        match=r"tp_plan entry 'model.layers.\*.self_attn.q_proj' matches no module of PeftModelForCausalLM .*"
        r"; it names a module of the model the peft wrapper holds: write "
        r"'base_model.model.model.layers.\*.self_attn.q_proj'",
    ):
        st.SeamlessTPUTrainer(lora_qwen3(peft), xla_spmd_config={"model_parallel_size": 2},
                              tp_plan={"model.layers.*.self_attn.q_proj": "colwise"})
    with pytest.raises(
        ValueError,
        match=rf"tp_plan splits '0' \(colwise\), a {re.escape(__name__)}.Linear; colwise and rowwise split "
        r"the weights of torch.nn.Linear and torch.nn.Embedding modules",
    ):
        st.SeamlessTPUTrainer(
            torch.nn.Sequential(Linear()), xla_spmd_config={"model_parallel_size": 2}, tp_plan={"0": "colwise"}
        )


def test_a_planned_peft_layer_off_xla_is_refused_with_the_fixes(peft, no_xla, monkeypatch):
    """torch's parallelize_module splits torch.nn.Linear only: a LoRA layer, or its base_layer alone (whose split output
    would meet the adapters' whole one), is refused before any work; a plan that leaves them out is built."""
    monkeypatch.setattr(st, "_torch_dist_ranks", lambda: (4, 0))
    model, config = lora_qwen3(peft), {"model_parallel_size": 2}
    fixes = (
        r"off XLA, torch's parallelize_module splits torch.nn.Linear and torch.nn.Embedding modules only, .* Run on "
        r"XLA "
        r"\(tensor parallelism works through peft there\), merge the adapters first "
        r"\(model.merge_and_unload\(\)\), or leave the "
        r"adapted modules out of tp_plan"
    )
    q_proj = "base_model.model.model.layers.*.self_attn.q_proj"
    with pytest.raises(
        NotImplementedError,
        match=rf"tp_plan\['{re.escape(q_proj)}'\] = 'colwise' plans 'base_model.model.model.layers.0."
        r"self_attn.q_proj', a peft tuner layer "
        rf"\(peft.tuners.lora.layer.Linear\); {fixes}",
    ):
        st._tp_layout(model, None, None, config, "fsdp", True)
    with pytest.raises(
        NotImplementedError,
        match=r"plans 'base_model.model.model.layers.0.self_attn.q_proj.base_layer', the base_layer "
        rf"of a peft tuner layer \(peft.tuners.lora.layer.Linear\); {fixes}",
    ):
        st._tp_layout(model, {q_proj + ".base_layer": "colwise"}, None, config, "fsdp", True)
    mlp = {
        "base_model.model.model.layers.*.mlp.up_proj": "colwise",
        "base_model.model.model.layers.*.mlp.down_proj": "rowwise",
    }
    planned, styles, ranks = st._tp_layout(model, mlp, None, config, "fsdp", True)
    assert planned == {} and sorted(styles) == sorted(mlp) and ranks == {"fsdp": 2, "model": 2}


def test_fake_xla_cpu_backward_first_is_a_clear_error(fake, monkeypatch):
    def broken(self, *a, **k):
        raise RuntimeError("0 <= device.index() && device.index() < device_ready_queues_.size() INTERNAL ASSERT FAILED")

    monkeypatch.setattr(torch.Tensor, "backward", broken)
    with pytest.raises(RuntimeError, match=r"a backward\(\) ran on CPU in this process before XLA was initialised"):
        st.get_device()


def test_fake_xla_sets_pjrt_device_only_when_unset(fake, monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE")
    st.get_device("xla")
    assert os.environ.pop("PJRT_DEVICE") == "CPU"  # popped: the hygiene fixture would flag it
    st._reset_caches()
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")
    st.get_device("xla")
    assert os.environ["PJRT_DEVICE"] == "CUDA"


# --- mesh rules and bad input --------------------------------------------------------------------


def seq_first_lm():
    """word_language_model's shape: (T, B) tokens through a batch_first=False LSTM."""
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(20, 8), "rnn": torch.nn.LSTM(8, 8),
                                "out": torch.nn.Linear(8, 20)})


@pytest.mark.parametrize("make,given,dim", [
    (scenarios.mlp, None, 0),
    (seq_first_lm, None, 1),  # batch_first=False RNNs and attention take (T, B, ...)
    (lambda: torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2), 2), None, 1),
    (lambda: torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, batch_first=True), 2), None, 0),
    (lambda: torch.nn.GRU(4, 4, batch_first=True), None, 0),
    (seq_first_lm, 0, 0),  # given, it wins: the model may transpose its input
    (scenarios.mlp, 2, 2),
])
def test_the_batch_dimension_is_where_the_model_says_or_where_the_user_does(make, given, dim):
    assert st._batch_dim(make(), given) == dim


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1", (0,)])
def test_a_batch_dim_that_is_no_dimension_index_is_refused_with_the_rule(cpu, bad):
    with pytest.raises(ValueError, match=r"batch_dim must be a dimension index >= 0 \(0 for \(B, T, ...\) batches, "
                                         rf"1 for \(T, B, ...\)\), got {re.escape(st._shown(bad))}$"):
        st.SeamlessTPUTrainer(scenarios.mlp(), device="cpu", batch_dim=bad)


def test_modules_that_disagree_on_the_batch_dimension_are_refused_naming_both(cpu):
    model = torch.nn.ModuleDict({"enc": torch.nn.GRU(4, 4, batch_first=True), "dec": torch.nn.LSTM(4, 4)})
    with pytest.raises(ValueError, match=r"disagree on where the batch is: 'enc' takes it first \(batch_first=True\), "
                                         r"'dec' second \(batch_first=False\); pass batch_dim=0 .* or batch_dim=1"):
        st.SeamlessTPUTrainer(model, device="cpu")
    st.SeamlessTPUTrainer(model, device="cpu", batch_dim=0)  # stated, there is nothing to decide


def test_seq_first_batches_split_their_batch_dimension_on_xla(fake):
    trainer = st.SeamlessTPUTrainer(seq_first_lm())
    assert trainer.layout.batch.dim == 1
    tokens = trainer.to_device(torch.zeros(5, 8, dtype=torch.long))  # (T, B)
    assert scenarios.sharding(tokens).startswith("{devices=[1,4]"), scenarios.sharding(tokens)
    assert scenarios.sharding(st.to_device(torch.zeros(5, 8))).startswith("{devices=[1,4]"), (
        "to_device() splits batches as the last trainer built does"
    )


def test_a_batch_dim_other_than_0_on_several_hosts_is_refused_with_the_fix(monkeypatch, fresh):
    FakeXLA(num_devices=16, process_count=4).install(monkeypatch)
    monkeypatch.setattr(st, "_agreement_group", lambda: None)  # its 3 peers do not exist
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(ValueError, match=r"batch_dim=1 on several hosts: torch_xla 2.9 assembles a multi-host batch "
                                         r"along dim 0 only .*x.transpose\(0, 1\)\) and pass batch_dim=0"):
        st.SeamlessTPUTrainer(seq_first_lm(), device="xla")


@pytest.mark.parametrize("devices,processes,shape,names", [
    (8, 1, (8,), ("data",)),
    (4, 1, (4,), ("data",)),
    (16, 4, (16,), ("data",)),  # however many processes hold them: a "model" axis is only ever asked for
    (16, 2, (16,), ("data",)),
])
def test_mesh_table(devices, processes, shape, names):
    assert st.mesh_shape_for(devices, processes) == (shape, names)


@pytest.mark.parametrize("config,shape,names", [
    ({"mesh_shape": [2, 2], "data_parallel_size": 2, "model_parallel_size": 2}, (2, 2), ("data", "model")),
    ({"mesh_shape": [4]}, (4,), ("data",)),
    ({"mesh_shape": [1, 2, 2], "axis_names": ["data", "fsdp", "model"]}, (1, 2, 2), ("data", "fsdp", "model")),
    ({"data_parallel_size": 2}, (2, 2), ("data", "model")),
    ({"model_parallel_size": 4}, (1, 4), ("data", "model")),
])
def test_explicit_spmd_config_wins(config, shape, names):
    assert st.mesh_shape_for(4, 1, xla_spmd_config=config) == (shape, names)


@pytest.mark.parametrize(
    "config,error,text",
    [
        ({"mesh_shape": [2, 3]}, ValueError, "mesh_shape (2, 3) holds 6 devices but the runtime has 4"),
        ({"data_parallel_size": 3, "model_parallel_size": 2}, ValueError, "3 x 2 != 4 devices"),
        ({"data_parallel_size": 3}, ValueError, "data_parallel_size x model_parallel_size must equal the device count"),
        ({"mesh_shape": [2, 2], "axis_names": ["data"]}, ValueError, "1 names ('data',) for mesh_shape (2, 2)"),
        ({"mesh_shape": [2, 2], "axis_names": ["x", "x"]}, ValueError, "unique non-empty strings, got ('x', 'x')"),
        ({"mesh_shape": [0, 4]}, ValueError, "mesh_shape entry must be a positive int, got 0"),
        ({"mesh_shape": [-2, -2]}, ValueError, "must be a positive int, got -2"),
        ({"mesh_shape": [2.0, 2]}, TypeError, "mesh_shape entry must be an int, got 2.0"),
        ({"mesh_shape": "2x2"}, TypeError, "mesh_shape must be a list of positive ints, got '2x2'"),
        (
            {"mesh_shape": [2, 2], "data_parallel_size": 4},
            ValueError,
            "contradicts itself: data_parallel_size=4, but mesh_shape (2, 2)",
        ),
        ({"mesh_shape": [2, 2], "data_parallel_size": 4, "model_parallel_size": 2}, ValueError, "data_parallel_size=4"),
        ({"mesh_shape": [2, 2, 1]}, ValueError, "a 3-D mesh_shape needs explicit axis_names"),
        ({"partitioning_mode": "auto"}, ValueError, "unknown keys ['partitioning_mode']; valid keys are"),
        ({"data_parallel_size": True}, TypeError, "data_parallel_size must be an int, got True"),
    ],
)
def test_bad_spmd_config(config, error, text):
    with pytest.raises(error) as info:
        st.mesh_shape_for(4, 1, xla_spmd_config=config)
    assert text in str(info.value)


@pytest.mark.parametrize("args,error,text", [
    ((0, 1), ValueError, "num_devices must be a positive int, got 0"),
    ((4, 3), ValueError, "4 devices over 3 processes"),
    (("4", 1), TypeError, "num_devices must be an int, got '4'"),
])
def test_bad_counts(args, error, text):
    with pytest.raises(error, match=text):
        st.mesh_shape_for(*args)


# 16x16x16: a full v4 pod (4096 chips); the size limit must let real slices through.
@pytest.mark.parametrize(
    "topology,dims",
    [
        ("2x2", (2, 2)),
        ("2x2x1", (2, 2, 1)),
        ("4x4x4", (4, 4, 4)),
        ("4x4x8", (4, 4, 8)),
        ("16x16x16", (16, 16, 16)),
        ("1x1", (1, 1)),
    ],
)
def test_parse_topology(topology, dims):
    assert st.parse_topology(topology) == dims


@pytest.mark.parametrize(
    "topology,error",
    [
        ("2", ValueError),
        ("2x", ValueError),
        ("x2", ValueError),
        ("2x0", ValueError),
        ("0x2", ValueError),
        ("2*2", ValueError),
        ("", ValueError),
        ("1x2x3x4", ValueError),
        ("2x2x2x2", ValueError),
        (" 2x2", ValueError),
        ("-2x2", ValueError),
        ("2x2\n", ValueError),
        ("4x4x4\n", ValueError),
        ("100000x100000", ValueError),
        (4, TypeError),
        (None, TypeError),
        ((2, 2), TypeError),
    ],
)
def test_bad_topology(topology, error):
    """The error says what a topology looks like and names the value it got."""
    with pytest.raises(error, match=r"topology .*got") as info:
        st.parse_topology(topology)
    assert repr(topology) in str(info.value)


@pytest.mark.parametrize(
    "topology", ["1" * 5000, "1" * 5000 + "x2", "2x" + "9" * 5000, "2x2x" + "0" * 4400 + "1", "100000x1"]
)
def test_topology_digits_are_bounded_before_conversion(topology):
    """More digits than any slice has: our rule, not Python's int-conversion limit (4300 digits)."""
    with pytest.raises(
        ValueError, match=r"topology must look like 'AxB' or 'AxBxC' with positive ints of at most 5 digits"
    ) as info:
        st.parse_topology(topology)
    assert "Exceeds the limit" not in str(info.value) and len(str(info.value)) < 400, "the value is shown truncated"


def test_topology_checked_against_device_count():
    assert st.mesh_shape_for(4, 1, topology="2x2") == ((4,), ("data",))
    assert st.mesh_shape_for(8, 1, topology="2x2") == ((8,), ("data",))  # v7: 2 devices per chip
    with pytest.raises(ValueError, match=r"topology '2x2' has 4 chips but the runtime has 6 devices"):
        st.mesh_shape_for(6, 1, topology="2x2")


def test_mesh_that_does_not_fit_is_a_value_error_not_an_assert(fake):
    scenarios.bad_mesh_raises_value_error()


# xla_spmd_config as given: the mesh shape for strategy="fsdp", sizes that contradict an explicit mesh, types

@pytest.mark.parametrize("devices,processes,config,want", [
    (4, 1, None, ((4,), ("fsdp",))),
    (16, 4, None, ((4, 4), ("data", "fsdp"))),
    (8, 2, None, ((2, 4), ("data", "fsdp"))),
    (4, 1, {"mesh_shape": [1, 4], "axis_names": ["data", "fsdp"]}, ((1, 4), ("data", "fsdp"))),
])
def test_fsdp_mesh_rules(devices, processes, config, want):
    assert st.mesh_shape_for(devices, processes, xla_spmd_config=config, strategy="fsdp") == want


@pytest.mark.parametrize("config,key", [
    ({"mesh_shape": [4], "model_parallel_size": 2}, "model_parallel_size"),
    # Whatever the axes are called, the trainer splits the batch over every axis not named 'model':
    # this x/y mesh is 4-way data parallel, so 2 contradicts it, and so does any model size but 1.
    ({"mesh_shape": [2, 2], "axis_names": ["x", "y"], "data_parallel_size": 2}, "data_parallel_size"),
    ({"mesh_shape": [2, 2], "axis_names": ["x", "y"], "model_parallel_size": 2}, "model_parallel_size"),
    ({"mesh_shape": [2, 2], "axis_names": ["x", "y"], "model_parallel_size": 4}, "model_parallel_size"),
], ids=["1d_with_model", "xy_with_data_2", "xy_with_model_2", "xy_with_model_4"])
def test_sizes_that_contradict_an_explicit_mesh(config, key):
    with pytest.raises(ValueError) as info:
        st._mesh_from_config(config, 4)
    assert key in str(info.value)


@pytest.mark.parametrize("config,want", [
    ({"mesh_shape": [2, 2], "axis_names": ["data", "model"], "model_parallel_size": 2}, ((2, 2), ("data", "model"))),
    ({"mesh_shape": [2, 2], "data_parallel_size": 2, "model_parallel_size": 2}, ((2, 2), ("data", "model"))),
    ({"mesh_shape": [4], "data_parallel_size": 4}, ((4,), ("data",))),
    ({"mesh_shape": [2, 2], "axis_names": ["x", "y"]}, ((2, 2), ("x", "y"))),
    ({"mesh_shape": [2, 2], "axis_names": ["x", "y"], "data_parallel_size": 4}, ((2, 2), ("x", "y"))),
], ids=["named_with_model", "both_sizes", "1d_with_data", "xy_without_sizes", "xy_is_4way_data"])
def test_consistent_explicit_mesh_passes(config, want):
    assert st._mesh_from_config(config, 4) == want


@pytest.mark.parametrize("config", [[], "", 0, [2, 2], "mesh"], ids=repr)
@pytest.mark.parametrize("entry", ["_mesh_from_config", "mesh_shape_for"])
def test_non_dict_config_is_a_type_error(config, entry):
    with pytest.raises(TypeError) as info:
        if entry == "mesh_shape_for":
            st.mesh_shape_for(4, 1, xla_spmd_config=config)
        else:
            st._mesh_from_config(config, 4)
    assert "xla_spmd_config" in str(info.value) and repr(config) in str(info.value)


@pytest.mark.parametrize("config", [{"axis_names": "data"}, {"mesh_shape": [2, 2], "axis_names": "xy"}], ids=repr)
def test_axis_names_as_a_string_is_a_type_error(config):
    with pytest.raises(TypeError) as info:
        st._mesh_from_config(config, 4)
    assert "axis_names" in str(info.value) and repr(config["axis_names"]) in str(info.value)


@pytest.mark.parametrize("config,key", [({1: 2}, 1), ({b"mesh_shape": [4]}, b"mesh_shape")], ids=repr)
def test_non_string_key_is_a_type_error(config, key):
    with pytest.raises(TypeError) as info:
        st._mesh_from_config(config, 4)
    assert repr(key) in str(info.value)


@child.requires("ray")
@pytest.mark.parametrize("config", [[2, 2], "2x2"], ids=repr)
def test_torch_config_rejects_a_non_dict_spmd_config(fresh, config):
    with pytest.raises(TypeError) as info:
        st.TorchConfig(backend="xla_tpu", xla_spmd_config=config)
    assert repr(config) in str(info.value)


# --- the Ray hook's pure parts: env contract and scaling check -----------------------------------


def worker_env(rank=1):
    return st._xla_worker_env(rank=rank, world_size=2, local_rank=0, local_world_size=1, node_rank=rank,
                              master_addr="10.0.0.1", master_port=1234, hostnames=["10.0.0.1", "10.0.0.2"])


def test_worker_env_contract():
    env = worker_env()
    assert env == {
        "PJRT_DEVICE": "TPU", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "RANK": "1", "WORLD_SIZE": "2",
        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "1", "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2",
    }
    assert not set(NEVER_READ) & set(env)


def test_user_env_survives(monkeypatch, fresh):
    monkeypatch.setenv("TPU_WORKER_ID", "7")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    for k in worker_env():
        if k not in ("TPU_WORKER_ID", "PJRT_DEVICE"):
            monkeypatch.delenv(k, raising=False)
    try:
        applied = st._setdefault_env(worker_env())
        assert os.environ["TPU_WORKER_ID"] == "7" and os.environ["PJRT_DEVICE"] == "CPU"
        assert "TPU_WORKER_ID" not in applied and applied["RANK"] == "1"
    finally:
        for k in set(worker_env()) - {"TPU_WORKER_ID", "PJRT_DEVICE"}:
            os.environ.pop(k, None)


def test_tpu_scaling_check():
    st._check_tpu_scaling(1, 4, "2x2")
    st._check_tpu_scaling(4, 4, "4x4")
    st._check_tpu_scaling(2, 1, None)
    with pytest.raises(ValueError, match=r"num_workers=2 x TPU per worker=4 = 8 chips, but topology '2x2' has 4 chips"):
        st._check_tpu_scaling(2, 4, "2x2")
    with pytest.raises(ValueError, match=r"topology must look like"):
        st._check_tpu_scaling(1, 4, "2by2")


class FakeContext:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def get_world_rank(self):
        return self.rank

    def get_world_size(self):
        return self.size

    def get_local_rank(self):
        return 0

    def get_local_world_size(self):
        return 1

    def get_node_rank(self):
        return self.rank


class FakeWorkerGroup:
    """Ray's worker group as the backend sees it (execute, execute_single, len). Each worker keeps its
    own env and its own module process state (one st._STATE object, swapped in), as separate
    processes would; order is not rank order."""

    def __init__(self, monkeypatch, envs):
        self.monkeypatch, self.envs, self.order = monkeypatch, envs, [1, 0]
        self.started_with = {rank: dict(env) for rank, env in envs.items()}  # each process's initial env
        self.state, self.meshes, self.logs = {}, {}, []
        self.patched = []  # ranks in the order their state first patched torch: close() undoes the newest first

    def __len__(self):
        return len(self.envs)

    def _run(self, rank, fn, *args, **kwargs):
        saved, outer = dict(os.environ), st._STATE
        os.environ.clear()
        os.environ.update(self.envs[rank])
        for probe in st._CACHED_PROBES:
            probe.cache_clear()
        st._STATE = self.state.setdefault(rank, st._ProcessState())
        self.monkeypatch.setattr(st, "_initial_environ", lambda: self.started_with[rank])
        self.monkeypatch.setattr(st, "_train_context", lambda: FakeContext(rank, len(self)))
        self.monkeypatch.setattr(st, "_node_ip", lambda: f"10.0.0.{rank + 1}")
        try:
            out = fn(*args, **kwargs)
            self.meshes[rank] = st.get_xla_mesh()
            return out
        finally:
            if st._STATE.torch_patches and rank not in self.patched:
                self.patched.append(rank)
            self.envs[rank] = dict(os.environ)
            os.environ.clear()
            os.environ.update(saved)
            st._STATE = outer

    def close(self):
        """What each worker process's exit would undo: its hooks and torch patches, newest first."""
        for rank in [*reversed(self.patched), *(r for r in self.state if r not in self.patched)]:
            st._STATE = self.state.pop(rank)
            st._reset_caches()

    def execute(self, fn, *args, **kwargs):
        return [self._run(rank, fn, *args, **kwargs) for rank in self.order]

    def execute_single(self, rank, fn, *args, **kwargs):
        return self._run(rank, fn, *args, **kwargs)


@child.requires("ray")
def test_ray_backend_with_fake_worker_group(fake, monkeypatch):
    base = {"PATH": os.environ.get("PATH", "")}
    group = FakeWorkerGroup(monkeypatch, {0: dict(base), 1: dict(base, TPU_WORKER_ID="7", PJRT_DEVICE="CPU")})
    backend = st._XlaSpmdBackend()
    config = st.TorchConfig(backend="xla_tpu", timeout_s=60)
    groups = []  # one process per worker would each join the gloo group; here they are recorded
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: groups.append((a, k)))
    for attempt in range(2):  # a restarted worker group runs the hook again
        groups.clear()
        backend.on_start(group, config)
        port = group.envs[0]["MASTER_PORT"]
        assert sorted(
            (k["rank"], a, k["init_method"], k["world_size"], k["timeout"].total_seconds()) for a, k in groups
        ) == [(rank, ("gloo",), f"tcp://10.0.0.1:{port}", 2, 60.0) for rank in (0, 1)], "a CPU group for checkpoints"
        assert group.envs[0]["TPU_WORKER_ID"] == "0" and group.envs[1]["TPU_WORKER_ID"] == "7"
        assert group.envs[0]["PJRT_DEVICE"] == "TPU" and group.envs[1]["PJRT_DEVICE"] == "CPU"
        for rank in (0, 1):
            env = group.envs[rank]
            assert env["TPU_WORKER_HOSTNAMES"] == "10.0.0.1,10.0.0.2", "worker IPs in rank order"
            assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "10.0.0.1"
            assert int(env["MASTER_PORT"]) > 0 and not set(NEVER_READ) & set(env)
            assert tuple(group.meshes[rank].mesh_shape) == (4,)
        backend.on_shutdown(group, config)
        assert group.meshes == {0: None, 1: None}
        for rank in (0, 1):  # back to what the user gave, for the next attempt
            group.envs[rank] = dict(base, **({"TPU_WORKER_ID": "7", "PJRT_DEVICE": "CPU"} if rank else {}))
    group.close()


@child.requires("ray")
def test_ray_worker_setup_logs_at_info_on_rank_0_only(fake, monkeypatch, caplog):
    """N workers do not print N copies: rank 0 at info, the others at debug, even where the user's
    own RANK env var says otherwise (the setup never overwrites it)."""
    base = {"PATH": os.environ.get("PATH", "")}
    group = FakeWorkerGroup(monkeypatch, {0: dict(base, RANK="1"), 1: dict(base, RANK="0")})
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: None)
    with caplog.at_level(logging.DEBUG, logger="seamless_tpu"):
        group.execute(st._xla_worker_setup, "10.0.0.1", 1234, "10.0.0.1,10.0.0.2", None, 60)
    said = {(r.levelname, r.getMessage().split(" set ")[0]) for r in caplog.records if " set " in r.getMessage()}
    assert said == {("INFO", "seamless_tpu: worker 0"), ("DEBUG", "seamless_tpu: worker 1")}, said
    group.close()


def test_ray_hook_destroys_only_the_group_it_started(monkeypatch, fresh):
    destroyed = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: destroyed.append(1))
    st._xla_worker_shutdown()
    assert destroyed == [], "a group the user started is theirs"
    st._STATE.group_we_started = True
    st._xla_worker_shutdown()
    st._xla_worker_shutdown()
    assert destroyed == [1]


# --- the layout as a value: decided for every case before anything moves ----------------------------------------


LAYOUT_CASES = {  # (device, ranks, trainer arguments) -> what the layout must say
    ("cpu", 1, "ddp"): dict(kind="cpu", mesh=None, batch=None, planned=0, wrap=None),
    ("cpu", 4, "ddp"): dict(kind="cpu", mesh=None, batch=None, planned=0, wrap="ddp"),
    ("cpu", 4, "fsdp"): dict(kind="cpu", mesh=None, batch=None, planned=0, wrap="fsdp2"),
    ("cpu", 4, "tp"): dict(kind="cpu", mesh=None, batch=None, planned=0, wrap="tp", rank_axes={"fsdp": 2, "model": 2},
                           data_ranks=(2, 0)),  # off XLA a plan goes with strategy="fsdp"
    ("xla", 1, "ddp"): dict(kind="xla", mesh={"data": 4}, batch=("data",), planned=0, wrap=None),
    ("xla", 1, "fsdp"): dict(kind="xla", mesh={"fsdp": 4}, batch=("fsdp",), planned=0, wrap=None),
    ("xla", 1, "tp"): dict(kind="xla", mesh={"data": 2, "model": 2}, batch=("data",), planned=3, wrap=None),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES), ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("meta", [False, True])
def test_a_layout_is_decided_for_every_case_without_placing_anything(monkeypatch, fresh, case, meta):
    """_plan_layout gives the layout of every (device, ranks, strategy or plan, meta) case as a value; the model's
    tensors stay where they were (CPU or meta): nothing is moved, split, wrapped or initialised, and the process mesh
    is the one it was."""
    device, ranks, how = case
    if device == "xla":
        FakeXLA().install(monkeypatch)
        monkeypatch.setenv("PJRT_DEVICE", "CPU")
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(st, "_torch_dist_ranks", lambda: (ranks, 1 if ranks == 4 else 0))
    with torch.device("meta" if meta else "cpu"):
        model = scenarios.mlp()
    args = {"ddp": {}, "fsdp": {"strategy": "fsdp"},
            "tp": {"xla_spmd_config": {"model_parallel_size": 2}, "tp_plan": scenarios.MLP_PLAN,
                   "strategy": "ddp" if device == "xla" else "fsdp"}}[how]
    process_mesh = st.get_device(device) and st.get_xla_mesh()  # on XLA: the default mesh, made by get_device
    layout = st._plan_layout(model, device, None, args.get("xla_spmd_config"), args.get("strategy", "ddp"),
                             args.get("tp_plan"))
    assert st.get_xla_mesh() is process_mesh, "the trainer installs its mesh, not the plan"
    want = dict(LAYOUT_CASES[case], meta=meta)
    got = dict(
        kind=layout.kind,
        mesh=layout.mesh and dict(st._axis_sizes(layout.mesh)),
        batch=layout.batch and layout.batch.axes,
        planned=len(layout.planned),
        wrap=layout.wrap,
        meta=layout.meta_built,
    )
    got.update({k: getattr(layout, k) for k in ("rank_axes", "data_ranks") if k in want})
    assert got == want, layout
    assert {p.device.type for p in model.parameters()} == {"meta" if meta else "cpu"}, "nothing moved"
    assert not st._STATE.meta_init.pending and type(model) is torch.nn.Sequential, "nothing laid out or wrapped"
    assert f"wrap={want['wrap']!r}" in repr(layout)
