"""torch_xla's own tests with a SeamlessTPUTrainer made, against plain torch_xla with SPMD on (issue 60): which tests
the module's process-wide changes (its lowerings above all) break, and which they fix.

    git -C XLA_REPO archive v2.9.0 test | tar -x -C /tmp/xla-suite   # the tag of the torch_xla installed
    python bench/torch_xla_suite.py /tmp/xla-suite/test [--files test_ops.py ...] [-k EXPR] [--out DIR] [--alone]

The first argument is the test/ dir of a pytorch/xla checkout; nothing of it is copied into this repository. Each
file runs twice under pytest on 4 virtual CPU devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=4, LLVM's optimisations off),
one process per file and mode, as SPMD is one-way: "plain" switches SPMD on (torch_xla.runtime.use_spmd()) before
the tests are imported; "trainer" does the same, then makes SeamlessTPUTrainer(torch.nn.Linear(2, 2)), which
registers the lowerings and patches process-wide (before op_db is imported: its OpInfos hold F's functions). This
file is that pytest plugin too (-p torch_xla_suite, mode in SEAMLESS_TPU_SUITE_MODE): it writes one JSON line per
test as it ends, so a process that dies (a signal, or pytest-timeout's --timeout) costs one test, recorded as
"crashed", and the file resumes past it in a new process. Two processes run side by side (--jobs).

Prints per file the tests (a unittest subTest counts as a test of its own: "NODEID [msg]") passed and failed in
each mode, then the regressions (pass plain, fail under the trainer) with the trainer's error, the fixes (fail plain,
pass under the trainer), and what is "lowered": test_ops.py's test_fallback asserts that torch_xla runs an op on the
CPU, which the trainer runs on XLA; such a failure counts as no regression only when the expected fallback is all
that is missing and each sample the test compares matches the CPU (its second is rerun alone for that). --alone
reruns each regression alone in a process per mode: one that passes alone depends on the tests before it. Writes
OUT/{plain,trainer}/FILE.jsonl and .log, and OUT/summary.json. Exit status 1 on a regression.
"""

import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("plain", "trainer")
# test_ops.py: torch's OpInfo samples against the CPU (test_reference_eager) and torch_xla's fallback checks;
# test_operations.py: torch_xla's op tests (embedding_bag's backward, pooling, upsampling, ...); test_core_aten_ops.py:
# aten ops one by one, each on XLA against the CPU with no aten:: fallback counted (subtests); the rest exercise the
# other patches: GRU, autocast, scan's backward (plain and SPMD), the mesh and sharding. Not here: test files that
# are scripts (test_grad_checkpoint.py) or import pytorch/xla's examples/ (scan/test_scan_layers.py).
FILES = ("test_ops.py", "test_operations.py", "test_core_aten_ops.py", "test_gru.py", "test_autocast.py",
         "scan/test_scan.py", "scan/test_scan_spmd.py", "spmd/test_xla_sharding.py")
OUTCOMES = ("passed", "failed", "error", "crashed", "skipped", "xfailed")
FAILED = ("failed", "error", "crashed")
# test_ops.py's test_fallback asserts the set of ops torch_xla ran on the CPU (met.executed_fallback_ops()), on its
# first MAX_SAMPLES_TO_RUN samples; where the trainer lowers them, the set it expects is missing: nothing else
FALLBACK_MISSING = "AssertionError: Set comparison failed: Items in the second set but not the first:"
FALLBACK_SAMPLES = 2
RESUMES = 20  # processes a file may take (each crash costs one); past that its remaining tests count as not run


# --- the plugin, in each pytest process ---------------------------------------------------------------------------

def pytest_configure(config):
    mode = os.environ.get("SEAMLESS_TPU_SUITE_MODE")
    if mode is None:
        return
    import torch
    import torch_xla.runtime as xr

    xr.use_spmd()  # before any XLA tensor: one made before it segfaulted on PJRT CPU
    if mode == "trainer":
        import seamless_tpu

        seamless_tpu.SeamlessTPUTrainer(torch.nn.Linear(2, 2))
    else:
        assert mode == "plain", mode
    config.pluginmanager.register(_Recorder(os.environ["SEAMLESS_TPU_SUITE_LOG"]), "torch_xla_suite_recorder")


def _done(path):
    """{nodeid: record} of the tests a log holds, and the test that started last without ending (or None)."""
    done, started = {}, None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if "start" in rec:
                    started = rec["start"]
                elif "test" in rec:
                    done[rec["test"]] = rec
                    started = None if started == rec["test"] else started
    return done, started


class _Recorder:
    """One JSON line as each test starts, and one as it ends: {test, outcome, message (its E lines), s}. A subtest
    (unittest's subTest: test_core_aten_ops.py's torch_xla_eval, torch_xla_metric, torch_xla_diff, ...) is a test of
    its own, "NODEID [msg]"."""

    def __init__(self, path):
        self.path, self.reports = path, {}
        self.log = open(path, "a", buffering=1)

    def pytest_collection_modifyitems(self, config, items):
        """A resumed file skips the tests its earlier processes ended (the one that killed the last included)."""
        done = _done(self.path)[0]
        keep = [item for item in items if item.nodeid not in done]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
            items[:] = keep

    def pytest_runtest_logstart(self, nodeid, location):
        self.log.write(json.dumps({"start": nodeid}) + "\n")

    def pytest_runtest_logreport(self, report):
        context = getattr(report, "context", None)  # a SubtestReport
        if context is not None:
            name = f"{report.nodeid} [{context.msg}]" + "".join(f" {k}={v}" for k, v in context.kwargs.items())
            return self.write(name, [report])
        self.reports.setdefault(report.nodeid, []).append(report)
        if report.when == "teardown":
            self.write(report.nodeid, self.reports.pop(report.nodeid))

    def write(self, name, reports):
        outcome, message = "passed", ""
        for r in reports:
            if r.failed:
                outcome = "failed" if r.when == "call" else "error"
                message = message or _message(r)
            elif r.skipped and outcome == "passed":
                outcome = "xfailed" if hasattr(r, "wasxfail") else "skipped"
        self.log.write(json.dumps({"test": name, "outcome": outcome, "message": message,
                                   "s": round(sum(r.duration for r in reports), 2)}) + "\n")


def _message(report):
    """The first lines pytest marks E (the error, with an assertion's detail and the exception it caused: torch's
    "Caused by sample input at index N"), or the crash's line."""
    lines = [line[1:].strip() for line in report.longreprtext.splitlines() if line.startswith("E ")]
    lines = [line for line in lines if line][:4] or [getattr(report.longrepr, "reprcrash", None) and
                                                    report.longrepr.reprcrash.message or str(report.longrepr)]
    return " | ".join(lines)[:600]


# --- the driver ---------------------------------------------------------------------------------------------------

def run_file(test_dir, file, mode, out, args, test=None, env_extra=None):
    """Runs one file (or one `test` of it) in one mode to its end, resuming past crashes: {nodeid: record}."""
    os.makedirs(os.path.join(out, mode), exist_ok=True)
    stem = os.path.join(out, mode, re.sub(r"[^\w.-]+", "_", test or file))
    log, text = stem + ".jsonl", stem + ".log"
    for path in (log, text):
        if os.path.exists(path):
            os.remove(path)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_SPMD", "SEAMLESS_TPU_DEVICE", "PJRT_DEVICE")}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_FLAGS="--xla_backend_optimization_level=0",
               TORCH_TEST_DEVICES=os.path.join(test_dir, "pytorch_test_base.py"), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([test_dir, os.path.dirname(os.path.join(test_dir, file)), ROOT, HERE]),
               SEAMLESS_TPU_SUITE_MODE=mode, SEAMLESS_TPU_SUITE_LOG=log, PYTHONUNBUFFERED="1", **(env_extra or {}))
    if mode == "trainer":
        env["SEAMLESS_TPU_DEVICE"] = "xla"
    command = [sys.executable, "-m", "pytest", os.path.join(test_dir, test or file), "-p", "torch_xla_suite", "-q",
               "--tb=short", "-p", "no:cacheprovider", "--rootdir", test_dir, "-o", "addopts=",
               "--timeout", str(args.timeout), "-o", "timeout_method=thread"] + (["-k", args.k] if args.k else [])
    deadline = time.monotonic() + args.file_timeout
    for _ in range(RESUMES):
        with open(text, "a") as f:
            seen = f.tell()
            try:
                rc = subprocess.run(command, cwd=test_dir, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=max(1, deadline - time.monotonic())).returncode
            except subprocess.TimeoutExpired:
                rc = None
        done, started = _done(log)
        if started is None:
            break  # every test collected ended (or collection failed: its lines say why)
        with open(text) as f:  # why the process ended with a test running
            f.seek(seen)
            timed_out = "+++ Timeout +++" in f.read()
        why = ("the file's time limit" if rc is None else f"pytest-timeout ({args.timeout} s)" if timed_out
               else f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}")
        with open(log, "a") as f:
            f.write(json.dumps({"test": started, "outcome": "crashed", "message": why, "s": None}) + "\n")
        if rc is None:
            break
    return _done(log)[0]


def lowered(test_dir, reg, out, args):
    """A regression that only says the trainer runs on XLA what torch_xla's test_fallback expects on the CPU: its
    failure is the fallback set's comparison with expected ops missing and none added. That test compares each of
    its first FALLBACK_SAMPLES samples with the CPU before its fallback check, so its first failure compared only
    the first: each other one is run alone (PYTORCH_OPINFO_SAMPLE_INPUT_INDEX), and must fail there in the same way
    (or run no sample)."""
    if not reg["trainer"]["message"].startswith(FALLBACK_MISSING):
        return False
    test = reg["test"].split(" [")[0]
    for index in range(1, FALLBACK_SAMPLES):
        now = run_file(test_dir, reg["file"], "trainer", os.path.join(out, f"sample{index}"), args, test=test,
                       env_extra={"PYTORCH_OPINFO_SAMPLE_INPUT_INDEX": str(index)}).get(test, {})
        reg[f"sample {index}"] = now
        if not (now.get("outcome") == "passed" or now.get("message", "").startswith(FALLBACK_MISSING)):
            return False
    return True


def rerun_alone(test_dir, reg, out, args):
    """The regression's test alone in a process per mode: {mode: outcome} (a subtest: its own)."""
    test = reg["test"].split(" [")[0]
    return {mode: run_file(test_dir, reg["file"], mode, os.path.join(out, "alone"), args, test=test).get(
        reg["test"], {}).get("outcome", "not run") for mode in MODES}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_dir", help="a pytorch/xla checkout's test/ directory")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="paths under test_dir")
    parser.add_argument("-k", help="pytest's -k, for every file")
    parser.add_argument("--out", default="/tmp/torch_xla_suite")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at a time")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a test may take (pytest-timeout)")
    parser.add_argument("--file-timeout", type=int, default=3600, help="seconds a file may take in one mode")
    parser.add_argument("--alone", action="store_true", help="rerun each regression alone, both ways")
    args = parser.parse_args(argv)
    test_dir, start = os.path.abspath(args.test_dir), time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {(file, mode): pool.submit(run_file, test_dir, file, mode, args.out, args)
                   for file in args.files for mode in MODES}
        results = {key: future.result() for key, future in futures.items()}
    summary, regressions, fixes = {"files": {}}, [], []
    for file in args.files:
        plain, trainer = results[file, "plain"], results[file, "trainer"]
        counts = {mode: {o: sum(r["outcome"] == o for r in run.values()) for o in OUTCOMES}
                  for mode, run in (("plain", plain), ("trainer", trainer))}
        summary["files"][file] = dict(counts, tests=len(set(plain) | set(trainer)))
        print(f"{file}: {len(set(plain) | set(trainer))} tests and subtests; " + "; ".join(
            f"{mode} " + ", ".join(f"{n} {o}" for o, n in c.items() if n) for mode, c in counts.items()))
        for nodeid in sorted(set(plain) | set(trainer)):
            was, now = (run.get(nodeid, {"outcome": "not run", "message": ""}) for run in (plain, trainer))
            if was["outcome"] == "passed" and now["outcome"] not in ("passed", "skipped", "xfailed"):
                regressions.append({"file": file, "test": nodeid, "trainer": now})
            elif was["outcome"] in FAILED and now["outcome"] == "passed":
                fixes.append({"file": file, "test": nodeid, "plain": was})
    lowers = [reg for reg in regressions if lowered(test_dir, reg, args.out, args)]
    regressions = [reg for reg in regressions if reg not in lowers]
    for reg in regressions if args.alone else ():
        reg["alone"] = rerun_alone(test_dir, reg, args.out, args)
    summary.update(regressions=regressions, lowered=lowers, fixes=fixes,
                   minutes=round((time.monotonic() - start) / 60, 1))
    for title, items, key in (("regressions", regressions, "trainer"), ("fixes", fixes, "plain"),
                              ("lowered: CPU fallbacks torch_xla's test expects, run on XLA", lowers, "trainer")):
        print(f"\n{title} ({len(items)}):")
        for item in items:
            alone = f"\n    alone: {item['alone']}" if "alone" in item else ""
            print(f"  {item['test']}\n    {key}: {item[key]['outcome']}: {item[key]['message'][:300]}{alone}")
    print(f"\n{summary['minutes']} min; {os.path.join(args.out, 'summary.json')}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
