"""The environment report with real torch_xla's runtime started (xla tier): `--probe` counts the 4 virtual CPU
devices and builds the default mesh, and the SPMD-lock check reads the real library's lock. tests/test_report.py
has the runs that never start it."""

import pytest

import child

pytestmark = [pytest.mark.xla, child.requires("torch_xla")]

LOCKED_FIRST = """
import torch, torch_xla
torch.zeros(1, device=torch_xla.device())  # an XLA tensor before SPMD: the lock seamless_tpu cannot undo
import seamless_tpu as st
print(st.environment_report())
"""


def test_cli_probe_counts_devices_processes_and_the_default_mesh():
    lines = child.run(["-m", "seamless_tpu", "--probe"], env=child.env(**child.XLA_ENV), timeout=180).stdout
    lines = lines.splitlines()
    assert "probe: xla:0: 4 devices, 1 process(es), default mesh (4,) ('data',)" in lines, lines
    assert "--probe starts the XLA runtime to count devices" not in lines and lines[-1] == "checks: all passed"


def test_report_shows_spmd_locked_by_an_earlier_xla_tensor():
    lines = child.run(["-c", LOCKED_FIRST], env=child.env(**child.XLA_ENV), timeout=180).stdout.splitlines()
    assert lines[-1] == ("! SPMD is locked off: an XLA tensor or torch_xla.device() came before SPMD was switched on. "
                         "Fix: build the trainer / call seamless_tpu.get_device() before anything touches an XLA "
                         "device"), lines
