"""Fixtures and tier markers for every test file: test_seamless_tpu.py here and tests/*.py.

It sits at the repository root, not in tests/: pytest applies a conftest.py only to the tests under
its own folder, and test_seamless_tpu.py stays at the top level. Test files import no fixtures;
helpers that tests share live in plain modules under tests/ (child.py, scenarios.py, ...).

Tiers (setup.cfg registers them; every test file names exactly one with `pytestmark`):
    fast       in-process, under a minute in all: no child process, no real torch_xla runtime, no Ray cluster
               (tests/fake_torch_xla.py stands in) (test_seamless_tpu.py, tests/test_inputs.py, tests/test_state.py)
    procs      seconds each, starts Python processes: gloo ranks, example and signal runs, no torch_xla runtime
               (tests/test_procs.py)
    xla        real torch_xla SPMD on 4 virtual CPU devices (tests/test_real_xla.py, tests/test_op_sweep.py,
               tests/test_opinfo.py, tests/test_report_xla.py, tests/test_autograd.py)
    ray        a real local Ray cluster (tests/test_ray.py, tests/test_ray_slice.py)
    workloads  third-party models on real torch_xla (tests/test_workloads.py)
    gpu        on a CUDA host only (skipped without one): the GPU path against the plain loop (tests/test_gpu.py)
Every tier but gpu means the CPU: on a GPU host, cuda_hidden makes torch.cuda.is_available() False for its tests and
tests/child.py gives their child processes CUDA_VISIBLE_DEVICES='', so they run as on CI.
`./dev.sh test -m fast` runs one tier; plain `./dev.sh test` runs them all, on 2 pytest-xdist workers (most tests wait
on child processes; the Ray tier on one worker). tests/DURATIONS.md has what each test of `-m "fast or procs"` took
on a 2-core machine: measure again before moving a test between tiers.
"""

import dataclasses
import os
import sys

import pytest
import torch

import seamless_tpu as st
from fake_torch_xla import FakeXLA

try:  # imported up front: ray's import writes RAY_CLIENT_MODE, which the hygiene check would flag
    import ray.train  # noqa: F401
except ImportError:
    pass

TIERS = ("fast", "procs", "xla", "ray", "workloads", "gpu")
LONGEST_FIRST = ("ray", "workloads", "xla", "procs", "fast", "gpu")
# Env vars others write, which the hygiene check does not count as a test's leak: pytest's bookkeeping, and what torch
# writes where unset (torch >= 2.10 on importing torch._dynamo, which an optimizer's constructor does; torch.compile's
# inductor and Triton on a first CUDA compile: seen with torch 2.11 on an H200)
NOT_OURS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")
st._reset_caches()  # the first test starts where the hygiene fixture leaves every later one


def pytest_collection_modifyitems(config, items):
    """Every test belongs to exactly one tier, so the tiers together are the whole suite."""
    tiers = {item: sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS}) for item in items}
    wrong = {item.nodeid: found for item, found in tiers.items() if len(found) != 1}
    if wrong:
        raise pytest.UsageError(f"each test needs exactly one tier marker of {TIERS} (pytestmark in its file): {wrong}")
    for item in items:  # ./dev.sh test's workers (pytest-xdist, --dist loadgroup): one runs every Ray cluster, in turn
        if tiers[item] == ["ray"]:
            item.add_marker(pytest.mark.xdist_group("ray"))
    # The longest first, so that the workers end together: the Ray tier (~14 min on one worker), then the workloads
    # (their largest ~4 min each); in collection order, the workloads came last and one worker ran them alone (CI
    # lost ~1.5 min so). The order within a tier is kept.
    items.sort(key=lambda item: LONGEST_FIRST.index(tiers[item][0]))


def _state_left():
    """The fields of the module's process state that differ from a fresh one."""
    now, fresh = st._STATE, st._ProcessState()
    left = [f.name for f in dataclasses.fields(now)
            if f.name not in ("activation_lock", "steps") and getattr(now, f.name) != getattr(fresh, f.name)]
    return left + (["steps"] if len(now.steps) else [])


def _torch_as_patched():
    """What the module changes in torch process-wide (global optimizer hooks, activation checkpointing, module
    conversion, the iteration of repeated blocks, the first step's FLOP-counting modes): _reset_caches() must put each
    back as the test found it. (The SIGTERM handler: tests/test_state.py's sigterm_restored, which runs after this
    check.)"""
    from torch.optim import optimizer

    return (len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks),
            torch.utils.checkpoint.CheckpointFunction, torch.utils.checkpoint._CheckpointFrame.__init__,
            torch.__future__.get_swap_module_params_on_conversion(), hasattr(torch, "xla"), torch.nn.Module.to,
            *(vars(cls)[name] for cls in (torch.nn.ModuleList, torch.nn.Sequential) for name in ("__iter__",
                                                                                                  "__getitem__")),
            torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack())  # the FLOP count's modes


@pytest.fixture(autouse=True)
def hygiene():
    """Fail any test that leaks env vars or leaves the module's caches or process state warm
    (a test that uses the module's state asks for `fresh`), or after which _reset_caches() leaves torch patched."""
    before = dict(os.environ)
    patched = _torch_as_patched()
    yield
    after = dict(os.environ)
    leaked = {k: after.get(k) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    for key in NOT_OURS:
        leaked.pop(key, None)
    warm = [p.__name__ for p in st._CACHED_PROBES if p.cache_info().currsize]
    left = _state_left()
    for k in leaked:  # put things back so one leak does not fail every later test
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    st._reset_caches()
    assert not leaked, f"test leaked env vars: {leaked}"
    assert not warm and not left, f"warm caches: {warm}; process state left behind: {left}"
    assert _torch_as_patched() == patched, (
        f"torch still patched after _reset_caches(): {patched} -> {_torch_as_patched()}"
    )


@pytest.fixture(autouse=True)
def cuda_hidden(request, hygiene, monkeypatch):
    """A test of any tier but gpu means the CPU: on a GPU host torch.cuda.is_available() is False for it (a test may
    patch it back). Not CUDA_VISIBLE_DEVICES here: the CUDA runtime reads it once per process, and the gpu tier may
    run later in this one."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fresh():
    """The module, with cold caches and a fresh process state at the end of the test."""
    yield st
    st._reset_caches()


@pytest.fixture
def no_xla(monkeypatch, fresh):
    """torch_xla cannot be imported, and no env var asks for a device."""
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    for k in ("PJRT_DEVICE", "SEAMLESS_TPU_DEVICE", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(k, raising=False)
    return st


@pytest.fixture
def cpu(no_xla, monkeypatch):
    """no_xla, and no GPU either (torch.cuda.is_available() is False): the device is the CPU on any machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return st


@pytest.fixture
def fake(monkeypatch, fresh):
    """The fake torch_xla (4 devices, one process) installed and asked for: SEAMLESS_TPU_DEVICE=xla."""
    fx = FakeXLA().install(monkeypatch)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("SEAMLESS_TPU_DEVICE", "xla")
    return fx
