"""How tests start another Python: a subprocess or a Ray worker, with the repository root, tests/ and bench/
(hlo.py, the HLO reader) on its path and the environment the test asks for. A plain module, not a test module.

    out = child.run(["tests/scenarios.py", name], env=child.env(**child.XLA_ENV), timeout=300)
    proc = child.popen(["-c", code], env=child.env(drop=child.DEVICE_VARS))

A child reports to its test in one way: child.report(obj) prints one line `RESULT <json>`, and the test reads
it with child.result(out.stdout).
"""

import atexit
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PYTHONPATH = os.pathsep.join([ROOT, HERE, os.path.join(ROOT, "bench")])  # for subprocesses and Ray workers
DEVICE_VARS = ("PJRT_DEVICE", "SEAMLESS_TPU_DEVICE")  # what picks the device: drop them for the default
# Real torch_xla on 4 virtual CPU devices, with LLVM's optimisations off: most of a test's XLA time is compiling
# (one small graph after another), about 3x faster so; the values are the same (no fast math either way), and the
# HLO the work tests read is XLA's, made before LLVM. The bench keeps them on: it times steps.
FAST_COMPILES = "--xla_backend_optimization_level=0"
XLA_ON_CPU = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4",
              "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILES}".strip()}
XLA_ENV = dict(XLA_ON_CPU, SEAMLESS_TPU_DEVICE="xla", PYTHONUNBUFFERED="1")
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30",
           "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_DEDUP_LOGS": "0"}
RAY_WRITES = ("PYTHONBREAKPOINT", "RAY_USAGE_STATS_ENABLED")  # ray.init() sets these in the driver for good


NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}  # a child of a test that means the CPU sees no GPU, on a GPU host too


def env(*, drop=(), path=PYTHONPATH, cuda=False, **extra):
    """This process's environment without the names in `drop`, with PYTHONPATH=`path`, plus `extra`; without
    `cuda` (the gpu tier's children), no GPU: CUDA_VISIBLE_DEVICES=''."""
    out = {k: v for k, v in os.environ.items() if k not in drop}
    out["PYTHONPATH"] = path
    out.update({} if cuda else NO_CUDA)
    out.update(extra)
    return out


_env = env  # the functions below take an `env` argument


def popen(args, *, env=None, cwd=ROOT, **kwargs):
    """Start `python ARGS` in `cwd` with `env` (default: env()); kwargs go to subprocess.Popen."""
    env = _env() if env is None else env
    return subprocess.Popen(command(args, env), cwd=cwd, env=env, **kwargs)


def command(args, env):
    """The command line of `python ARGS` in `env`: for an XLA child (a script, PJRT_DEVICE=CPU), the same run by a
    fork of a server that imported torch and torch_xla in that environment (tests/zygote.py: ~10 s of CPU less a
    child), unless SEAMLESS_TPU_TEST_COLD=1."""
    args = [str(a) for a in args]
    if env.get("PJRT_DEVICE") != "CPU" or not args[0].endswith(".py") or os.environ.get("SEAMLESS_TPU_TEST_COLD"):
        return [sys.executable, *args]
    return [sys.executable, zygote.__file__, "run", _server(env), *args]


_SERVERS = {}  # {the environment but its late names: (the server process, its socket)}, at most 3 alive
_SERVERS_LOCK = threading.Lock()  # the bench's smoke run starts children from 2 threads


def _server(env):
    """The socket of a live server for `env` (but its late names), started if there is none."""
    key = tuple(sorted((k, v) for k, v in env.items() if not zygote.late(k)))
    with _SERVERS_LOCK:
        if key in _SERVERS and _SERVERS[key][0].poll() is None:
            return _SERVERS[key][1]
        while len(_SERVERS) >= 3:
            _stop(*_SERVERS.pop(next(iter(_SERVERS))))
        path = os.path.join(tempfile.mkdtemp(prefix="zygote"), "socket")
        proc = subprocess.Popen([sys.executable, zygote.__file__, "serve", path], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if proc.stdout.readline().strip() != b"READY":
            raise RuntimeError(f"tests/zygote.py serve exited {proc.wait()} before it was ready")
        _SERVERS[key] = proc, path
        return path


def _stop(proc, path):
    proc.kill()
    proc.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@atexit.register
def _stop_all():
    for server in _SERVERS.values():
        _stop(*server)


def report(obj):
    """What a child process tells its test: one line `RESULT <json of obj>` on stdout, flushed."""
    print("RESULT " + json.dumps(obj), flush=True)


def result(stdout, *, required=True):
    """The object a child's report() printed in `stdout`; with required=False, None if it printed none
    (a process that ended by a signal). More than one report fails: each child reports once."""
    lines = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1 or not (lines or required), f"expected one RESULT line, got {len(lines)}:\n{stdout[-3000:]}"
    return json.loads(lines[0]) if lines else None


def kib(field):
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: the peak since clear_refs)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def assert_ok(returncode, stdout, stderr, what="child"):
    """Fail with the child's output if it crashed (a segfault: 139 / -11) or exited non-zero."""
    assert returncode not in (139, -11), f"{what} crashed (segfault):\n{stderr[-3000:]}"
    assert returncode == 0, f"{what} exited {returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"


def run(args, *, env=None, timeout, cwd=ROOT, check=True):
    """Run `python ARGS` to the end, output captured as text; with `check`, a failure fails the test."""
    env = _env() if env is None else env
    out = subprocess.run(command(args, env), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert_ok(out.returncode, out.stdout, out.stderr, f"python {' '.join(map(str, args))[:200]}")
    return out


def run_together(commands, *, timeout, cwd=ROOT, stderr=False):
    """Start every (args, env) in `commands` at once (the ranks of one world), wait for all, fail on
    any failure; returns their stdouts in order (with `stderr`, (stdout, stderr) pairs). A hang fails at
    `timeout` instead of stalling CI."""
    procs = [popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, env in commands]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    failed = []
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        try:
            assert_ok(p.returncode, out, err, f"process {i} of {len(procs)}")
        except AssertionError as e:
            failed.append(str(e))
    assert not failed, "\n\n".join(failed)  # every one: the first to fail is often not process 0
    return outs if stderr else [out for out, _ in outs]


def requires(*modules):
    """A skip mark for a tier that needs `modules` installed (./dev.sh test installs them all)."""
    import pytest

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (./dev.sh test installs it)")


@contextlib.contextmanager
def ray_env(**extra):
    """RAY_ENV (and `extra`) set for the block; what ray.init() writes into this process's
    environment is put back after it, so a Ray test leaks nothing into the next test."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        for k in RAY_WRITES:
            mp.delenv(k, raising=False)
        for k, v in dict(RAY_ENV, **extra).items():
            mp.setenv(k, v)
        yield
