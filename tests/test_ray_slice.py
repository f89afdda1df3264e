"""Multi-host use_tpu=True on a simulated TPU slice: a local Ray cluster of 2 "hosts" (nodes) with
4 TPU each, labelled and named as Ray's TPU support expects of a v4-16 (topology 2x2x2). Ray
gang-schedules the slice; seamless_tpu's TorchTrainer must route it to the XLA SPMD backend.

What Ray 2.60 needs to schedule a multi-host slice, found by trying: the resource
TPU-<pod>-head on worker 0, node labels ray.io/tpu-slice-name, -worker-id, -pod-type, the resource
accelerator_type:TPU-V4, and TPU_NAME (the slice name Ray reads on the head, as on GKE).
XLA itself runs on CPU (PJRT_DEVICE=CPU through the worker runtime_env): no TPU exists here.
"""

import json
import os

import pytest

ray = pytest.importorskip("ray")

import child  # noqa: E402
import seamless_tpu as st  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("fresh")]  # fresh: see tests/test_ray.py

SLICE = "slice-a"
LABELS = {"ray.io/tpu-slice-name": SLICE, "ray.io/tpu-pod-type": "v4-16", "ray.io/accelerator-type": "TPU-V4",
          "ray.io/tpu-topology": "2x2x2"}


def report_env(config):
    import json
    import os

    import ray.train
    import seamless_tpu

    rank = ray.train.get_context().get_world_rank()
    keys = ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_VISIBLE_CHIPS", "PJRT_DEVICE", "RANK", "WORLD_SIZE")
    with open(os.path.join(config["out"], f"w{rank}.json"), "w") as f:
        json.dump({**{k: os.environ.get(k) for k in keys}, "mesh": list(seamless_tpu.get_xla_mesh().mesh_shape),
                   "device_type": seamless_tpu.device_type()}, f)


@child.requires("torch_xla")
@pytest.mark.timeout(300)
def test_two_host_slice_runs_the_xla_backend(tmp_path):
    with child.ray_env(TPU_NAME=SLICE):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        try:
            for worker_id in range(2):
                resources = {
                    "TPU": 4,
                    "accelerator_type:TPU-V4": 1,
                    **({"TPU-v4-16-head": 1} if worker_id == 0 else {}),
                }
                cluster.add_node(
                    num_cpus=2, resources=resources, labels={**LABELS, "ray.io/tpu-worker-id": str(worker_id)}
                )
            ray.init(address=cluster.address,
                     runtime_env={"env_vars": {"PYTHONPATH": child.PYTHONPATH, **child.NO_CUDA}})
            (tmp_path / "out").mkdir()
            scaling = ScalingConfig(num_workers=2, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4")
            assert scaling.num_tpus_per_worker == 4
            st.TorchTrainer(
                report_env,
                train_loop_config={"out": str(tmp_path / "out")},
                scaling_config=scaling,
                run_config=RunConfig(
                    storage_path=str(tmp_path / "ray"), worker_runtime_env={"env_vars": child.XLA_ON_CPU}
                ),
            ).fit()
        finally:
            ray.shutdown()
            cluster.shutdown()
    workers = [json.load(open(tmp_path / "out" / f"w{rank}.json")) for rank in (0, 1)]
    for rank, w in enumerate(workers):
        assert w["TPU_WORKER_ID"] == w["RANK"] == str(rank) and w["WORLD_SIZE"] == "2"
        assert w["TPU_VISIBLE_CHIPS"] == "0,1,2,3", "one SPMD worker holds all chips of its host"
        assert w["device_type"] == "xla" and w["mesh"] == [4]
        assert len(w["TPU_WORKER_HOSTNAMES"].split(",")) == 2
    assert os.environ.get("TPU_NAME") is None
