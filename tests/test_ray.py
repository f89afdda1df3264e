"""Ray tier: seamless_tpu's TorchTrainer/TorchConfig on a real local Ray 2.60 cluster (2 CPUs,
4 simulated TPU resources). One cluster for the module; every test is bounded, because Ray waits
forever on resources it cannot get instead of failing."""

import glob
import json
import os
import re
import time

import pytest
import torch

ray = pytest.importorskip("ray")

import child  # noqa: E402
import scenarios  # noqa: E402
import seamless_tpu as st  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray_loops import EPOCHS, STEPS  # noqa: E402

XLA_ON_CPU = child.XLA_ON_CPU
NEVER_READ = scenarios.NEVER_READ
needs_xla = child.requires("torch_xla")
# "thread": a fit() stuck inside Ray's C++ never returns to the interpreter, so SIGALRM would never
# fire; this method dumps every stack and ends pytest instead, so CI fails instead of hanging.
# fresh: the driver builds seamless_tpu's Ray classes, which warms the module's import cache.
EXAMPLE = os.path.join(child.ROOT, "example_train.py")
RAY_FSDP = "--ray --num-workers 2 --epochs 2 --strategy fsdp".split()  # the example on 2 Ray CPU workers, FSDP2
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300, method="thread"), pytest.mark.usefixtures("fresh")]


def test_example_ray_two_workers_fsdp2_with_checkpoints(tmp_path):
    """Runs first, before this module's cluster exists: the example starts its own. With
    --strategy fsdp the 2 CPU workers run FSDP2, and both write their shards into one checkpoint."""
    out = child.run([EXAMPLE, *RAY_FSDP, "--checkpoint-dir", "ckpt"], env=child.env(**child.RAY_ENV), cwd=tmp_path,
                    timeout=240)
    text = out.stdout + out.stderr
    finals = dict(re.findall(r"worker (\d) final loss ([0-9.]+)", text))
    assert set(finals) == {"0", "1"}, text[-4000:]  # each its own last batch's loss
    assert all(0 < float(v) < 1.2 for v in finals.values())
    step = (tmp_path / "ckpt" / "LATEST").read_text()
    assert sorted(p.name for p in (tmp_path / "ckpt" / step).iterdir()) == [
        ".metadata", ".seamless_tpu_attempt", "__0_0.distcp", "__1_0.distcp", "objects.pt", "values.pt"]
    assert st.consolidate_checkpoint(tmp_path / "ckpt")["epoch"] == 1


def test_example_ray_two_workers_tensor_parallel():
    """--tp 2 on 2 CPU workers: one tensor-parallel group (torch's TP over gloo, then FSDP2 over a data
    dimension of 1) reads every batch, so both workers end with the single-process CPU run's loss."""
    env = child.env(**child.RAY_ENV)
    single = child.run([EXAMPLE, "--device", "cpu", "--epochs", "2"], env=env, timeout=240)
    want = re.findall(r"final loss ([0-9.]+)", single.stdout)[-1]
    out = child.run([EXAMPLE, *RAY_FSDP, "--tp", "2"], env=env, timeout=240)
    finals = dict(re.findall(r"worker (\d) final loss ([0-9.]+)", out.stdout + out.stderr))
    assert finals == {"0": want, "1": want}, (finals, want)


@pytest.fixture(scope="module")
def cluster():
    with child.ray_env():
        ray.init(num_cpus=2, resources={"TPU": 4}, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": child.PYTHONPATH, **child.NO_CUDA}})
        try:
            yield
        finally:
            ray.shutdown()


def wait_for_free_cpus(seconds=60):
    """Ray 2.60 keeps the placement group of a run whose backend failed to start (seen after
    test_xla_backend_without_torch_xla_fails_clearly), holding a CPU until the cluster stops; the
    next group would time out waiting for it. No run of ours is live here, so drop such groups."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    deadline = time.monotonic() + seconds
    while ray.available_resources().get("CPU", 0) < 2:
        for pg_id, info in placement_group_table().items():
            if info["state"] == "CREATED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
        assert time.monotonic() < deadline, f"Ray CPUs still held after {seconds}s: {ray.available_resources()}"
        time.sleep(1)


def fit(loop, tmp_path, trainer_cls=None, worker_env=None, config=None, failures=0, **kwargs):
    from ray_loops import RecordReports

    wait_for_free_cpus()
    (tmp_path / "out").mkdir(exist_ok=True)
    run = RunConfig(
        storage_path=str(tmp_path / "ray"),
        worker_runtime_env={"env_vars": worker_env or {}},
        failure_config=FailureConfig(max_failures=failures),
        callbacks=[RecordReports(str(tmp_path / "out"))],
    )
    trainer_cls = trainer_cls or st.TorchTrainer
    trainer = trainer_cls(
        loop, train_loop_config={"out": str(tmp_path / "out"), **(config or {})}, run_config=run, **kwargs
    )
    return trainer.fit()


def read(tmp_path, name):
    with open(tmp_path / "out" / f"{name}.json") as f:
        return json.load(f)


def read_lines(tmp_path, name):
    with open(tmp_path / "out" / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


def test_cpu_fallback_two_workers_ddp(cluster, tmp_path):
    from ray_loops import ddp_cpu

    fit(ddp_cpu, tmp_path, scaling_config=ScalingConfig(num_workers=2))
    r0, r1 = read(tmp_path, "ddp_0"), read(tmp_path, "ddp_1")
    assert r0["device_type"] == r1["device_type"] == "cpu"
    assert r0["replicated_in_place"], "DDP applied to the user's module itself (torch's composable replicate)"
    assert r0["weights"] == r1["weights"], "ranks must end with bitwise-equal weights"
    for e0, e1 in zip(r0["seen"], r1["seen"]):
        assert not set(e0) & set(e1) and sorted(e0 + e1) == list(range(40)), "disjoint samples covering the dataset"
    assert r0["seen"][0] != r0["seen"][1], "the sampler's epoch advances"


@needs_xla
def test_xla_worker_matches_eager_and_keeps_user_env(cluster, tmp_path):
    from ray_loops import xla_plain_loop

    fit(xla_plain_loop, tmp_path, torch_config=st.TorchConfig(backend="xla_tpu"),
        worker_env=dict(XLA_ON_CPU, TPU_WORKER_ID="7"), scaling_config=ScalingConfig(num_workers=1))
    r = read(tmp_path, "xla_0")
    assert r["is_xla"] and r["device_type"] == "xla" and (r["mesh"], r["axes"]) == ([4], ["data"])
    want = scenarios.plain_loop("eager", "adam")
    assert (torch.tensor(r["losses"]) - want).abs().max().item() <= 1e-5
    assert r["env"]["TPU_WORKER_ID"] == "7" and r["env"]["PJRT_DEVICE"] == "CPU", "user-set values are untouched"


@needs_xla
def test_two_xla_workers_env_contract(cluster, tmp_path):
    from ray_loops import xla_plain_loop

    fit(xla_plain_loop, tmp_path, torch_config=st.TorchConfig(backend="xla"), worker_env=XLA_ON_CPU,
        scaling_config=ScalingConfig(num_workers=2))
    envs = [read(tmp_path, f"xla_{rank}") for rank in (0, 1)]
    ip = ray.util.get_node_ip_address()
    for rank, r in enumerate(envs):
        env = r["env"]
        assert r["mesh"] == [4], "CPU PJRT cannot join processes: each worker has its own 4-device world"
        assert env["TPU_WORKER_ID"] == str(rank) and env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] in ("0", "1") and env["MASTER_ADDR"] == ip and int(env["MASTER_PORT"]) > 0
        assert env["TPU_WORKER_HOSTNAMES"] == f"{ip},{ip}" and env["PJRT_DEVICE"] == "CPU"
        assert all(env[k] is None for k in NEVER_READ), {k: env[k] for k in NEVER_READ}
    assert envs[0]["env"]["MASTER_PORT"] == envs[1]["env"]["MASTER_PORT"]


@needs_xla
def test_use_tpu_routes_to_the_xla_backend(cluster, tmp_path):
    from ray_loops import device_type_only

    fit(device_type_only, tmp_path, worker_env=XLA_ON_CPU, scaling_config=ScalingConfig(num_workers=1, use_tpu=True))
    assert read(tmp_path, "routed") == {"device_type": "xla", "mesh": [4]}


@pytest.mark.parametrize("workers,per_worker,topology", [(2, 4, "2x4"), (1, 8, None)])
def test_use_tpu_without_the_tpus_fails_at_once(cluster, tmp_path, workers, per_worker, topology):
    """The cluster has 4 TPU: asking for more used to wait forever inside Ray; now fit() refuses at once."""
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=rf"asks for num_workers={workers} x {per_worker} TPU = 8 TPU, but the Ray cluster has 4"
    ):
        fit(
            lambda: None,
            tmp_path,
            scaling_config=ScalingConfig(
                num_workers=workers,
                use_tpu=True,
                topology=topology,
                accelerator_type="TPU-V6E",
                resources_per_worker={"TPU": per_worker},
            ),
        )
    assert time.monotonic() - start < 60


def test_plain_ray_use_tpu_needs_torch_tpu(cluster, tmp_path):
    """Why this module exists: Ray's own use_tpu path wants torch_tpu, which cannot share an env with torch_xla."""
    from ray.train.torch import TorchTrainer as RayTorchTrainer
    from ray_loops import device_type_only

    with pytest.raises(Exception, match="torch_tpu is not available"):
        fit(device_type_only, tmp_path, trainer_cls=RayTorchTrainer, worker_env=XLA_ON_CPU,
            scaling_config=ScalingConfig(num_workers=1, use_tpu=True))


def crash_run(tmp_path, name, **kwargs):
    from ray_loops import crash_resume

    path = tmp_path / name
    path.mkdir()
    fit(crash_resume, path, failures=1, **kwargs)
    return path


def assert_resumed(crashed, clean, tol):
    assert os.path.exists(crashed / "out" / "crashed"), "the worker really died"
    reports = read_lines(crashed, "reports")
    epochs = [r["epochs"][0] for r in reports]
    assert epochs == list(range(EPOCHS)), f"each epoch reported exactly once (as registered by Ray): {epochs}"
    assert all(len(set(r["epochs"])) == 1 and r["checkpoint"] for r in reports)
    starts = read_lines(crashed, "starts")
    assert len({s["pid"] for s in starts}) == len(starts) == 2 * len(read_lines(clean, "starts")), (
        "a new group was started"
    )
    got, want = read(crashed, "final")["weights"], read(clean, "final")["weights"]
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert diff <= tol, f"resumed weights differ from an uninterrupted run by {diff}"
    return starts


def test_topology_contradiction_fails_before_workers_start():
    with pytest.raises(ValueError, match=r"num_workers=2 x TPU per worker=4 = 8 chips, but topology '2x2' has 4 chips"):
        st.TorchTrainer(
            lambda: None,
            scaling_config=ScalingConfig(num_workers=2, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E"),
        )
    with pytest.raises(ValueError, match=r"topology '4x4' has 16 chips"):
        st.TorchTrainer(
            lambda: None,
            torch_config=st.TorchConfig(backend="xla_tpu"),
            scaling_config=ScalingConfig(num_workers=1, use_tpu=True, topology="4x4", resources_per_worker={"TPU": 4}),
        )


def test_use_gpu_and_use_tpu_still_rejected():
    with pytest.raises(ValueError, match=r"Cannot specify both `use_gpu=True` and `use_tpu=True`"):
        st.TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1, use_gpu=True, use_tpu=True))


def test_torch_config_routing_and_validation():
    from ray.train.torch.config import _TorchBackend

    assert st.TorchConfig(backend="xla_tpu").backend_cls is st._XlaSpmdBackend
    assert st.TorchConfig(backend="xla").backend_cls is st._XlaSpmdBackend
    assert st.TorchConfig(backend="gloo").backend_cls.__bases__ == (_TorchBackend,), "Ray's, plus the SIGTERM handler"
    assert (
        st.TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1)).backend_config.backend_cls
        is st._RayTorchBackend
    )
    assert st.TorchConfig().train_func_context is ray.train.torch.TorchConfig().train_func_context
    with pytest.raises(ValueError, match=r"xla_spmd_config needs backend='xla_tpu', got backend='gloo'"):
        st.TorchConfig(backend="gloo", xla_spmd_config={"mesh_shape": [4]})
    with pytest.raises(TypeError, match=r"mesh_shape must be a list of positive ints, got '2x2'"):
        st.TorchConfig(backend="xla_tpu", xla_spmd_config={"mesh_shape": "2x2"})
    with pytest.raises(ValueError, match=r"contradicts itself: data_parallel_size=4"):
        st.TorchConfig(backend="xla_tpu", xla_spmd_config={"mesh_shape": [2, 2], "data_parallel_size": 4})
    trainer = st.TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1, use_tpu=True))
    assert trainer.backend_config.backend == "xla_tpu"


def test_xla_backend_without_torch_xla_fails_clearly(cluster, tmp_path):
    blocker = tmp_path / "block" / "torch_xla"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch_xla is blocked for this test')\n")
    from ray_loops import device_type_only

    env = dict(XLA_ON_CPU, PYTHONPATH=os.pathsep.join([str(blocker.parent), child.PYTHONPATH]))
    with pytest.raises(Exception) as info:
        fit(device_type_only, tmp_path, torch_config=st.TorchConfig(backend="xla_tpu"), worker_env=env,
            scaling_config=ScalingConfig(num_workers=1))
    assert "seamless_tpu needs torch_xla for this: pip install 'torch_xla[tpu]==2.9.0'" in str(info.value)
    assert not glob.glob(str(tmp_path / "out" / "*.json")), "the train function never ran"


FSDP2_CPU = dict(scaling_config=ScalingConfig(num_workers=2), config={"sharded": True, "strategy": "fsdp"})


@pytest.fixture(scope="module")
def fsdp2_clean(cluster, tmp_path_factory):
    """The uninterrupted FSDP2 run that the crash and the preemption tests both compare with."""
    return crash_run(tmp_path_factory.mktemp("fsdp2"), "clean", **FSDP2_CPU)


def test_sharded_checkpoint_crash_and_resume_fsdp2_cpu(fsdp2_clean, tmp_path):
    """strategy='fsdp' on 2 CPU workers is torch's FSDP2; every worker saves its shards into one
    directory and reports it; after a worker dies the run resumes through load_checkpoint."""
    crashed = crash_run(tmp_path, "crashed", **dict(FSDP2_CPU, config={**FSDP2_CPU["config"], "crash": True}))
    assert_resumed(crashed, fsdp2_clean, tol=0.0)
    assert read(fsdp2_clean, "final")["model"] == "FSDPSequential", (
        "fully_shard made the user's own module an FSDP module"
    )


def test_sigterm_on_one_worker_saves_on_both_at_one_step_and_ray_resumes_there(fsdp2_clean, tmp_path):
    """A spot VM's SIGTERM reaches the last of 2 FSDP2 CPU workers mid-epoch 3. Ray runs the loop on a
    thread, so the backend installs the trainer's handler on each worker's main thread, and it holds
    Ray's own exit back: both workers see trainer.preempted after the same step, save and report there.
    The attempt then ends as failed, so Ray restarts it; the restart resumes at that step through
    ray.train.get_checkpoint() and ends bitwise where the uninterrupted run ends."""
    run = crash_run(tmp_path, "preempted", **dict(FSDP2_CPU, config={**FSDP2_CPU["config"], "preempt": True}))
    stops = sorted(read_lines(run, "preempted"), key=lambda s: s["rank"])
    assert [s["rank"] for s in stops] == [0, 1] and stops[0]["at"] == stops[1]["at"] == [2, STEPS // 2 + 2], \
        f"both workers stop one step after the step that follows the signal (its agreement is read then): {stops}"
    starts = read_lines(run, "starts")
    assert [s["at"] for s in starts] == [[0, 0], [0, 0], [2, STEPS // 2 + 2], [2, STEPS // 2 + 2]], starts
    assert stops[1]["pid"] in {s["pid"] for s in starts[:2]}, "the signalled worker lived on to save"
    assert len({s["pid"] for s in starts}) == 4, "Ray restarted the group"
    assert [r["epochs"][0] for r in read_lines(run, "reports")] == [0, 1, 2, 2, 3, 4], (
        "the preemption's report registered"
    )
    got, want = read(run, "final")["weights"], read(fsdp2_clean, "final")["weights"]
    assert got == want, "the resumed run ends bitwise where the uninterrupted one ends"


@needs_xla
def test_sharded_checkpoint_crash_and_resume_xla(cluster, tmp_path):
    """Two XLA workers, each its own 4-device world, save fsdp shards into one directory through the
    gloo group the xla_tpu backend starts; one dies; the run resumes with the uninterrupted weights."""
    kwargs = dict(torch_config=st.TorchConfig(backend="xla_tpu"), worker_env=XLA_ON_CPU,
                  scaling_config=ScalingConfig(num_workers=2), config={"sharded": True, "strategy": "fsdp"})
    clean = crash_run(tmp_path, "clean", **kwargs)
    crashed = crash_run(tmp_path, "crashed", **dict(kwargs, config={**kwargs["config"], "crash": True}))
    starts = assert_resumed(crashed, clean, tol=1e-6)
    assert sorted(s["worker_id"] for s in starts) == ["0", "0", "1", "1"] and all(s["mesh"] == [4] for s in starts)
