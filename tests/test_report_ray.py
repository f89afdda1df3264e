"""`python -m seamless_tpu --ray=ADDRESS` on a real local Ray cluster of 2 nodes (ray tier): one report per node,
then the cluster's checks, here the nodes' differing TPU counts (4 and 8, simulated resources). Bounded: Ray waits
forever on what it cannot get instead of failing."""

import re

import pytest

ray = pytest.importorskip("ray")

import child  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120, method="thread")]  # thread: see tests/test_ray.py


def test_cli_ray_reports_each_node_and_flags_differing_tpu_counts():
    with child.ray_env():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"TPU": 4},
                                                                "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1, resources={"TPU": 8})
            cluster.wait_for_nodes()
            out = child.run(["-m", "seamless_tpu", f"--ray={cluster.address}"], env=child.env(**child.RAY_ENV),
                            timeout=90)
        finally:
            cluster.shutdown()
    text = out.stdout
    headers = re.findall(r"^=== node (\S+ \(\w{8}\)), Ray TPU resource (\d+) ===$", text, re.M)
    assert sorted(tpu for _, tpu in headers) == ["4", "8"], text
    assert len(re.findall(r"^versions: python 3\.", text, re.M)) == 2, text
    assert len(re.findall(r"^device: cpu: ", text, re.M)) == 2, text
    assert "=== cluster: 2 nodes ===" in text
    (flag,) = [line for line in text.splitlines() if line.startswith("! nodes hold different TPU counts")]
    assert flag.startswith(f"! nodes hold different TPU counts ({headers[0][0]}: {headers[0][1]}, "
                           f"{headers[1][0]}: {headers[1][1]}). Fix: SPMD needs the same chips"), flag
