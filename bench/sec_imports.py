"""Section imports: milliseconds to import seamless_tpu, accelerate and lightning.fabric after torch, each in a
fresh interpreter."""

import importlib
import os
import statistics
import time

from harness import EAGER_ENV, ROOT, report, run_child


def import_cost(repeats):
    """Comparison 5: milliseconds to import each module in a fresh interpreter after torch."""
    modules = ("seamless_tpu", "accelerate", "lightning.fabric")
    results = {k: [] for k in modules}
    env = dict(os.environ, PYTHONPATH=ROOT, **EAGER_ENV)
    for _ in range(repeats):
        for module in modules:
            results[module].append(run_child("import", module, env=env) * 1e3)
    return results


def import_child(module):
    """Seconds to import `module` in this fresh interpreter, after torch (and the bench's own stdlib imports,
    alike for every module)."""
    import torch  # noqa: F401

    start = time.perf_counter()
    importlib.import_module(module)
    report(time.perf_counter() - start)


def render_imports(imports, s):
    md = ["| module | median | min | max |", "|---|---|---|---|"]
    md += [f"| {name} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} |" for name, v in imports.items()]
    return md, [
        "import after torch (median ms): " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in imports.items())
    ]
