"""What XLA compiled, read from the HLO text it dumps (XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text ...).
The benchmark and the tests (which find bench/ on their path) read it the same way.

dot_flops_per_device(DIR) compares the forward and backward's dot (and, with count=matmul_flops, convolution) FLOPs
just before SPMD partitioning (the whole step) with just after it (one device's share), so later rewrites (a
matrix-vector dot turned into a reduce) count on neither side: a mesh of N devices on which no device
repeats another's work gives 1/N. step_collectives(DIR, shapes) counts the collectives of the step's optimized graphs.
"""

import glob
import math
import os
import re

DUMP_FLAGS = "--xla_dump_to={} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=spmd-partitioning"

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([0-9,]*)\]", re.M)
DOT = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([0-9,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\), (?:lhs_batch_dims=\{[0-9,]*\}, )?"
    r"lhs_contracting_dims=\{([0-9,]*)\}",
    re.M,
)
CONVOLUTION = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([0-9,]*)\]\S* convolution\(%[\w.\-]+, %([\w.\-]+)\),.*?"
    r"dim_labels=\w+_(\w+)->", re.M,
)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
PARAM_GATHER = "all-gather of a parameter's shape"
FLOAT_GATHER = "all-gather of floats"  # activations or weights; not the u32 index bookkeeping of per-step slices
COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(COLLECTIVES) + r")\(")
SHAPE = re.compile(r"\b(f32|bf16|f16|f64|s32|s64|u32|pred)\[([0-9,]*)\]")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "s64": 8, "u32": 4, "pred": 1}


def dims(text):
    return [int(d) for d in text.split(",") if d]


def live(hlo):
    """The HLO text without its dead instructions (those no ROOT reaches): before partitioning the graph still holds
    some (the input gradient of a first convolution whose input needs none), which partitioning then drops, so
    counting them would credit the split with work nobody does."""
    lines = hlo.splitlines()
    uses = {m[1]: set(re.findall(r"%([\w.\-]+)", line[m.end():])) for line in lines
            for m in [re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)] if m}
    todo = [m[1] for line in lines for m in [re.match(r"\s*ROOT %([\w.\-]+) = ", line)] if m]
    todo += [name for line in lines if "calls=" in line or "to_apply=" in line  # called computations' instructions
             for name in re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)]
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += uses.get(name, ())
    return "\n".join(line for line in lines if (m := re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)) is None
                     or m[1] in seen)


COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{[ \t]*$", re.M)


def runs(hlo):
    """[(a computation's text, how many times one run of the module runs it)]: a While body (a loop of repeated
    blocks) its trip count, the constant its condition compares the counter with, per run of its caller."""
    texts, entry = {}, None
    for m in COMPUTATION.finditer(hlo):
        texts[m[2]], entry = hlo[m.end():hlo.find("\n}", m.end())], m[2] if m[1] else entry
    counts = dict.fromkeys(texts, 0)

    def visit(name, times):
        counts[name] += times
        for line in texts[name].splitlines():
            loop = re.search(r"condition=%([\w.\-]+), body=%([\w.\-]+)", line)
            if loop:
                trip = re.search(r"constant\(([0-9]+)\)", texts[loop[1]])
                visit(loop[2], times * (int(trip[1]) if trip else 1))
            for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line):
                visit(callee, times)
    if entry is None:  # a bare instruction list (a test's HLO snippet): run once
        return [(hlo, 1)]
    visit(entry, 1)
    return [(texts[name], n) for name, n in counts.items() if n]


def dot_flops(hlo):
    """2 x output elements x contracted size, summed over every live dot in an HLO module's text (batched ones,
    such as attention's products, included), each as many times as its computation runs (a loop's body: N)."""
    hlo = live(hlo)
    shapes = {name: dims(shape) for name, shape in INSTRUCTION.findall(hlo)}
    return sum(n * 2 * math.prod(dims(out)) * math.prod(shapes[lhs][i] for i in dims(contracted))
               for text, n in runs(hlo) for out, lhs, contracted in DOT.findall(text))


def conv_flops(hlo):
    """2 x output elements x what each one sums (the kernel's elements over its output features), summed over every
    convolution: forward, input gradient and weight gradient alike, grouped ones too (the kernel's 'i' is C/groups;
    a weight gradient's kernel is the output gradient, whose 'o' is the features and the rest the batch and space),
    each as many times as its computation runs."""
    hlo = live(hlo)
    shapes = {name: dims(shape) for name, shape in INSTRUCTION.findall(hlo)}
    return sum(n * 2 * math.prod(dims(out)) * math.prod(shapes[rhs]) // shapes[rhs][labels.index("o")]
               for text, n in runs(hlo) for out, rhs, labels in CONVOLUTION.findall(text))


def matmul_flops(hlo):
    return dot_flops(hlo) + conv_flops(hlo)


def _modules(dump, skip=()):
    """[(module, its HLO just before SPMD partitioning, just after)] in the order XLA compiled them into `dump`,
    leaving out the files in `skip` (those of an earlier run in the same process: dumped_files(dump))."""
    found = []
    for before in sorted(set(glob.glob(os.path.join(dump, "module_*SyncTensorsGraph*before_spmd-partitioning.txt")))
                         - set(skip)):  # not ReplicateShardedData: a split tensor's read to the host
        module = re.sub(r"\.[0-9]{4}\.spmd-partitioner\..*", "", before)  # module_0001.SyncTensorsGraph.122
        with open(before) as f, open(glob.glob(glob.escape(module) + ".*.after_spmd-partitioning*.txt")[0]) as g:
            found.append((module, f.read(), g.read()))
    return found


def _step_graphs(dump, skip=(), count=dot_flops):
    """The training step's graphs: the one with the most FLOPs by `count` (the forward and backward; the graphs that
    read losses back or make the optimizer's state hold fewer) and those compiled after it (the optimizer's step)."""
    modules = _modules(dump, skip)
    flops = [(count(before), count(after)) for _, before, after in modules]
    if not flops or not max(flops)[0]:
        raise AssertionError(f"no partitioned graph with a dot or a convolution in {dump}: was XLA_FLAGS set before "
                             "XLA started?")
    first = flops.index(max(flops))
    return modules[first:], flops[first]


def dot_flops_per_device(dump, skip=(), count=dot_flops):
    """(whole step's dot FLOPs, one device's, the ratio) for the forward and backward's graph (_step_graphs), read
    just before SPMD partitioning (the whole step) and just after it (one device's share); matmul_flops as `count`
    adds the convolutions."""
    _, (whole, one) = _step_graphs(dump, skip, count)
    return whole, one, one / whole


def dumped_files(dump):
    return set(glob.glob(os.path.join(dump, "*")))


def step_collectives(dump, param_shapes, skip=()):
    """Collectives in the training step's graphs (_step_graphs: the forward and backward, then the optimizer's step),
    read from the partitioned, optimized HLO that XLA_FLAGS=--xla_dump_to wrote: {op: (count, bytes)}, bytes being
    each op's result on one device, each op as many times as its computation runs (a loop's body: N). "all-gather of
    a parameter's shape" counts the all-gathers whose result has the shape of a whole parameter (or its transpose, 1s
    aside): FSDP's weight gathers; the others move activations. Files in `skip` (an earlier run's) are left out."""
    try:
        modules, _ = _step_graphs(dump, skip, matmul_flops)
    except AssertionError:
        return {}
    computations = []  # (a computation's text, how many times a step runs it)
    for module, _, _ in modules:
        with open(glob.glob(glob.escape(module) + ".*after_optimizations.txt")[0]) as f:
            computations += runs(f.read())
    unit = lambda dims: tuple(d for d in dims if d != 1)  # noqa: E731  XLA adds and drops 1s (conv1d as a conv2d)
    shapes = {unit(s) for s in param_shapes} | {unit(reversed(s)) for s in param_shapes}
    found = {}
    for shape, op, n in ((shape, op, n) for text, n in computations for shape, op in COLLECTIVE.findall(text)):
        parts = [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in SHAPE.findall(shape)]
        size = sum(DTYPE_BYTES[t] * math.prod(dims) for t, dims in parts)
        keys = [op] + ([PARAM_GATHER] if op == "all-gather" and all(unit(d) in shapes for _, d in parts) else [])
        keys += [FLOAT_GATHER] if op == "all-gather" and all(t[0] in "fb" for t, _ in parts) else []
        for key in keys:
            count, total = found.get(key, (0, 0))
            found[key] = (count + n, total + n * size)
    return found
