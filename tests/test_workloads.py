"""Real-workloads tier: third-party models (transformers + peft LoRA, torchvision resnet18, a GAN,
activation checkpointing) trained through seamless_tpu on real torch_xla SPMD with 4 virtual CPU
devices, each against the same loop run eagerly in a separate process (tests/workloads.py).

Every scenario runs in a fresh interpreter: SPMD cannot be switched off inside a process.
"""

import pytest

import block_loops
import child
import workloads

pytestmark = [
    pytest.mark.workloads,
    child.requires("torch_xla", "transformers", "peft", "torchvision"),
    pytest.mark.timeout(400),
]


@pytest.mark.parametrize("script, name", [("workloads", n) for n in workloads.SCENARIOS]
                         + [("block_loops", n) for n in block_loops.SCENARIOS], ids=lambda v: v)
def test_workload_on_real_torch_xla(script, name):
    """tests/workloads.py's scenarios, and tests/block_loops.py's: repeated blocks as one loop (issue 48)."""
    out = child.run([f"tests/{script}.py", name], env=child.env(**child.XLA_ENV), timeout=380, check=False)
    print(out.stdout[-4000:])
    child.assert_ok(out.returncode, out.stdout, out.stderr, f"{script} {name}")
    assert child.result(out.stdout)["scenario"] == name


def test_llama_tensor_parallel_on_four_gloo_ranks(tmp_path):
    """Off XLA: a transformers Llama with its own plan, torch's tensor parallelism over 2 ranks and FSDP2
    over the other 2, gives the losses of eager on the whole batch (tests/dist_ranks.py)."""
    env = child.env(SEAMLESS_TPU_DEVICE="cpu", drop=child.DEVICE_VARS)
    outs = child.run_together(
        [
            (["tests/dist_ranks.py", "tensor_parallel_llama", rank, 4, tmp_path / "store", tmp_path], env)
            for rank in range(4)
        ],
        timeout=300,
    )
    for out in outs:
        seen = child.result(out)
        assert seen["diff"] <= 1e-5, seen["losses"]
