"""The environment report (`python -m seamless_tpu`, seamless_tpu.environment_report): its checks and the cluster's
as pure functions fed bad states, then the CLI in child processes: torch only (a vendored copy, torch_xla and ray
blocked), real torch_xla imported but never started, torch_xla's own PJRT_DEVICE guess, a TPU worker id out of range.
The runs that start a runtime are in tests/test_report_xla.py (--probe) and tests/test_report_ray.py (--ray).
"""

import shutil

import pytest
import torch

import child
import seamless_tpu as st

pytestmark = pytest.mark.procs

VERSIONS = {"python": "3.11.7", "torch": "2.9.0+cu128", "torch_xla": "2.9.0", "libtpu": "0.0.21", "ray": "2.60.0",
            "transformers": "not installed"}
# Host 1 of a 2-host slice, 4 chips, PJRT_DEVICE chosen by the user, one process holding every chip: nothing wrong.
GOOD_ENV = {"PJRT_DEVICE": "TPU", "TPU_WORKER_HOSTNAMES": "host-a,host-b", "TPU_WORKER_ID": "1",
            "TPU_VISIBLE_CHIPS": "0,1,2,3", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}
GOOD_FACTS = {"versions": VERSIONS, "chips": 4, "chip_evidence": "Google PCI devices", "hostname": "host-b",
              "host_ip": "10.0.0.2", "xla_loaded": True, "user_pjrt": "TPU", "spmd_locked": False}
WORKER_FIX = ("list every host once, in worker order, in TPU_WORKER_HOSTNAMES (the same on every host) and set "
              "TPU_WORKER_ID to this host's position in it, from 0")
VISIBLE_FIX = ("for SPMD one process must hold all of its host's chips: unset TPU_VISIBLE_CHIPS (on Ray give one "
               "worker all the host's TPUs)")


def test_a_good_environment_passes_every_check():
    assert st._environment_checks(GOOD_ENV, GOOD_FACTS) == []


@pytest.mark.parametrize("env, facts, problem, fix", [
    ({}, {"spmd_locked": True},
     "SPMD is locked off: an XLA tensor or torch_xla.device() came before SPMD was switched on",
     "build the trainer / call seamless_tpu.get_device() before anything touches an XLA device"),
    ({"PJRT_DEVICE": "CPU"}, {"user_pjrt": None},
     "PJRT_DEVICE=CPU was written by torch_xla's import guess, not by you",
     "set PJRT_DEVICE yourself (TPU or CPU) or SEAMLESS_TPU_DEVICE"),
    ({"TPU_VISIBLE_CHIPS": "0,1"}, {},
     "TPU_VISIBLE_CHIPS=0,1 holds 2 of this host's 4 chips", VISIBLE_FIX),
    ({"TPU_VISIBLE_CHIPS": "0"}, {"chips": 0},  # no chip evidence: the host's bounds 2,2,1 say 4
     "TPU_VISIBLE_CHIPS=0 holds 1 of this host's 4 chips", VISIBLE_FIX),
    ({"TPU_WORKER_ID": "one"}, {},
     "TPU_WORKER_ID is not a whole number (TPU_WORKER_ID='one', TPU_WORKER_HOSTNAMES='host-a,host-b')", WORKER_FIX),
    ({"TPU_WORKER_ID": "2"}, {},
     "TPU_WORKER_ID is not in range(2) (TPU_WORKER_ID='2', TPU_WORKER_HOSTNAMES='host-a,host-b')", WORKER_FIX),
    ({"TPU_WORKER_HOSTNAMES": "host-a,host-a,host-b", "TPU_WORKER_ID": "2"}, {},
     "TPU_WORKER_HOSTNAMES names a host twice (TPU_WORKER_ID='2', TPU_WORKER_HOSTNAMES='host-a,host-a,host-b')",
     WORKER_FIX),
    ({"TPU_WORKER_ID": "0"}, {},
     "this host (host-b) is number 1 in TPU_WORKER_HOSTNAMES, not 0 (TPU_WORKER_ID='0', "
     "TPU_WORKER_HOSTNAMES='host-a,host-b')", WORKER_FIX),
    ({"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2", "TPU_WORKER_ID": "0"}, {},  # listed by IP address
     "this host (host-b) is number 1 in TPU_WORKER_HOSTNAMES, not 0 (TPU_WORKER_ID='0', "
     "TPU_WORKER_HOSTNAMES='10.0.0.1,10.0.0.2')", WORKER_FIX),
    ({}, {"versions": dict(VERSIONS, torch="2.8.0")},
     "torch_xla 2.9.0 is built for torch 2.9.0, but torch is 2.8.0", "pip install torch==2.9.0 torch_xla==2.9.0"),
], ids=["spmd_locked", "pjrt_guessed", "visible_of_chips", "visible_of_bounds", "worker_id_not_int",
        "worker_id_out_of_range", "duplicate_hostnames", "host_at_another_position", "host_ip_at_another_position",
        "torch_xla_for_another_torch"])
def test_each_check_names_its_problem_and_fix(env, facts, problem, fix):
    assert st._environment_checks({**GOOD_ENV, **env}, {**GOOD_FACTS, **facts}) == [(problem, fix)]


@pytest.mark.parametrize("env, facts", [
    ({}, {"spmd_locked": True, "xla_loaded": False}),  # the lock is torch_xla's in-process state: only if loaded
    ({"PJRT_DEVICE": "CPU"}, {"user_pjrt": None, "xla_loaded": False}),  # no torch_xla loaded: nobody guessed it
    ({"TPU_VISIBLE_CHIPS": "0,1,2,3,4,5,6,7"}, {"chips": 4}),  # more than the host's: not a part of it
    ({"TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_HOST_BOUNDS": None}, {"chips": 0}),  # None: unset
    ({"TPU_WORKER_HOSTNAMES": "", "TPU_WORKER_ID": "7"}, {}),  # no list to be out of range of
    ({}, {"versions": dict(VERSIONS, torch="2.8.0", torch_xla="not installed")}),
], ids=["lock_without_torch_xla", "pjrt_without_torch_xla", "more_chips_visible", "visible_without_host_size",
        "worker_id_without_hostnames", "torch_without_torch_xla"])
def test_checks_stay_quiet_where_nothing_is_wrong(env, facts):
    env = {k: v for k, v in {**GOOD_ENV, **env}.items() if v is not None}
    assert st._environment_checks(env, {**GOOD_FACTS, **facts}) == []


def test_cluster_checks_flag_duplicate_worker_ids_and_differing_tpu_counts():
    head = {"node": "10.0.0.9", "worker_id": None, "tpu": 0, "chips": 0}  # a CPU-only head: no TPU host
    a, b = ({"node": f"10.0.0.{i}", "worker_id": str(i), "tpu": 4.0, "chips": 4} for i in (1, 2))
    assert st._cluster_checks([head, a, b]) == []
    assert st._cluster_checks([head, a, dict(b, worker_id="1")]) == [(
        "TPU_WORKER_ID=1 is set on 2 nodes (10.0.0.1, 10.0.0.2)",
        "give each host of a slice its own TPU_WORKER_ID: its position in TPU_WORKER_HOSTNAMES")]
    (problem, fix), = st._cluster_checks([head, a, dict(b, tpu=8.0, chips=0)])
    assert problem == "nodes hold different TPU counts (10.0.0.9: 0, 10.0.0.1: 4, 10.0.0.2: 8)"
    assert fix.startswith("SPMD needs the same chips on every host of a slice")
    assert st._cluster_checks([a, dict(b, tpu=0, chips=8)])[0][0].startswith("nodes hold different TPU counts")
    assert st._cluster_checks([head, a, dict(b, tpu=4.0, chips=8)])[-1][0] == (
        "10.0.0.2: Ray's TPU resource is 4 but the host has 8 chips")


TORCH_ONLY = """
import runpy, sys
sys.modules["torch_xla"] = None
sys.modules["ray"] = None
sys.argv = ["seamless_tpu.py"]
runpy.run_path("seamless_tpu.py", run_name="__main__")  # as `python seamless_tpu.py` (-m needs the same lookup)
print("loaded:", sorted(m for m in sys.modules if m.startswith(("torch_xla", "ray")) and sys.modules[m]))
"""


def test_cli_with_torch_only_reports_versions_and_cpu(tmp_path):
    """A vendored copy alone, torch_xla and ray blocked, no GPU: the report picks the CPU and says why."""
    shutil.copy(st.__file__, tmp_path / "seamless_tpu.py")
    env = child.env(drop=child.DEVICE_VARS, path=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    out = child.run(["-c", TORCH_ONLY], env=env, cwd=tmp_path, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("versions: python 3.") and f", torch {torch.__version__.split('+')[0]}" in lines[0]
    assert all(f", {name} " in lines[0] for name in ("torch_xla", "libtpu", "ray", "transformers")), lines[0]
    assert lines[1] == "device: cpu: no torch_xla, no CUDA", out.stdout
    assert "counts: 0 CUDA devices, " in out.stdout and "--probe starts the XLA runtime to count devices" in lines
    assert lines[-2:] == ["checks: all passed", "loaded: []"], out.stdout
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


NO_PROBE = """
import runpy, sys
sys.argv = ["seamless_tpu"]
runpy.run_module("seamless_tpu", run_name="__main__")
print("torch_xla imported:", "torch_xla" in sys.modules, "ray imported:", "ray" in sys.modules)
"""


@child.requires("torch_xla")
def test_cli_on_xla_without_probe_never_imports_torch_xla():
    out = child.run(["-c", NO_PROBE], env=child.env(**child.XLA_ENV), timeout=120)
    lines = out.stdout.splitlines()
    assert "device: xla: SEAMLESS_TPU_DEVICE=xla asks for it" in lines, out.stdout
    assert {"  CPU_NUM_DEVICES=4", "  PJRT_DEVICE=CPU", "  SEAMLESS_TPU_DEVICE=xla"} <= set(lines), out.stdout
    assert "--probe starts the XLA runtime to count devices" in lines
    assert any(line.startswith("compile cache: off on XLA:CPU (torch_xla 2.9 writes it but cannot read it back")
               for line in lines), out.stdout
    assert lines[-2:] == ["checks: all passed", "torch_xla imported: False ray imported: False"], out.stdout


IMPORTED_FIRST = """
import torch_xla  # as transformers does when torch_xla is installed: it writes PJRT_DEVICE=CPU if unset
import seamless_tpu as st
print(st.environment_report())
"""


@child.requires("torch_xla")
@pytest.mark.parametrize("user_pjrt", [None, "CPU"])
def test_report_shows_pjrt_device_written_by_torch_xla_import(user_pjrt):
    env = child.env(drop=child.DEVICE_VARS, **({"PJRT_DEVICE": user_pjrt} if user_pjrt else {}))
    lines = child.run(["-c", IMPORTED_FIRST], env=env, timeout=120).stdout.splitlines()
    guessed = ("! PJRT_DEVICE=CPU was written by torch_xla's import guess, not by you. Fix: set PJRT_DEVICE yourself "
               "(TPU or CPU) or SEAMLESS_TPU_DEVICE")
    assert "  PJRT_DEVICE=CPU" in lines
    if user_pjrt:
        assert "device: xla: PJRT_DEVICE=CPU set by the user" in lines and lines[-1] == "checks: all passed", lines
    else:
        assert "device: cpu: torch_xla, but no TPU chip and no PJRT_DEVICE, no CUDA" in lines and lines[-1] == guessed


def test_cli_flags_a_tpu_worker_id_out_of_range_and_shows_a_detection_error():
    env = child.env(drop=child.DEVICE_VARS, TPU_WORKER_HOSTNAMES="a,b", TPU_WORKER_ID="5", SEAMLESS_TPU_DEVICE="tpu")
    out = child.run(["-m", "seamless_tpu"], env=env, timeout=120)
    lines = out.stdout.splitlines()
    assert {"  TPU_WORKER_HOSTNAMES=a,b", "  TPU_WORKER_ID=5", "  SEAMLESS_TPU_DEVICE=tpu"} <= set(lines)
    assert any(line.startswith("device: error: device 'tpu' was requested but no TPU chip is visible")
               for line in lines), out.stdout
    assert lines[-1] == f"! TPU_WORKER_ID is not in range(2) (TPU_WORKER_ID='5', TPU_WORKER_HOSTNAMES='a,b'). Fix: " \
                        f"{WORKER_FIX}", out.stdout
