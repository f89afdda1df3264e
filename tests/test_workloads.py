"""Real-workloads tier: third-party models (transformers + peft LoRA, torchvision resnet18, a GAN,
activation checkpointing) trained through seamless_tpu on real torch_xla SPMD with 4 virtual CPU
devices, each against the same loop run eagerly in a separate process (tests/workloads.py).

Every scenario runs in a fresh interpreter: SPMD cannot be switched off inside a process.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

import workloads

MISSING = [m for m in ("torch_xla", "transformers", "peft", "torchvision") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (./dev.sh test installs them)"),
    pytest.mark.timeout(400),
]

XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "SEAMLESS_TPU_DEVICE": "xla", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("name", list(workloads.SCENARIOS))
def test_workload_on_real_torch_xla(name):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([workloads.ROOT, workloads.HERE]), **XLA_ENV)
    out = subprocess.run([sys.executable, os.path.join(workloads.HERE, "workloads.py"), name], cwd=workloads.ROOT,
                         env=env, capture_output=True, text=True, timeout=380)
    print(out.stdout[-4000:])
    assert out.returncode not in (139, -11), f"segfault:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}"
    assert f"scenario {name}: OK" in out.stdout
