"""Real tier of issue 48: repeated blocks as one loop on real torch_xla SPMD (4 virtual CPU devices), each scenario
in a fresh interpreter against eager PyTorch in another (tests/block_loops.py)."""

import pytest

import block_loops
import child

pytestmark = [pytest.mark.workloads, child.requires("torch_xla", "transformers", "peft"), pytest.mark.timeout(600)]


@pytest.mark.parametrize("name", list(block_loops.SCENARIOS))
def test_block_loops_on_real_torch_xla(name):
    out = child.run(["tests/block_loops.py", name], env=child.env(**child.XLA_ENV), timeout=580, check=False)
    print(out.stdout[-4000:])
    child.assert_ok(out.returncode, out.stdout, out.stderr, f"block_loops {name}")
    assert child.result(out.stdout)["scenario"] == name
