"""What XLA compiled, read from the HLO text it dumps around the SPMD partitioner (XLA_FLAGS=DUMP_FLAGS).

dot_flops_per_device(DIR) compares the last graph's dot FLOPs just before SPMD partitioning (the
whole step) with just after it (one device's share), so later rewrites (a matrix-vector dot turned
into a reduce) count on neither side: a mesh of N devices on which no device repeats another's work
gives 1/N.
"""

import glob
import math
import os
import re

DUMP_FLAGS = "--xla_dump_to={} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=spmd-partitioning"

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([0-9,]*)\]", re.M)
DOT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([0-9,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\), lhs_contracting_dims=\{([0-9,]*)\}", re.M)


def dims(text):
    return [int(d) for d in text.split(",") if d]


def dot_flops(hlo):
    """2 x output elements x contracted size, summed over every dot in an HLO module's text."""
    shapes = {name: dims(shape) for name, shape in INSTRUCTION.findall(hlo)}
    return sum(2 * math.prod(dims(out)) * math.prod(shapes[lhs][i] for i in dims(contracted))
               for out, lhs, contracted in DOT.findall(hlo))


def dot_flops_per_device(dump):
    """(whole step's dot FLOPs, one device's, the ratio) for the graph with the most dot FLOPs that XLA
    compiled into `dump` (the training step: the graphs that read losses back hold no dots)."""
    best = (0, 0)
    for before in glob.glob(os.path.join(dump, "module_*before_spmd-partitioning.txt")):
        module = re.sub(r"\.[0-9]{4}\.spmd-partitioner\..*", "", before)  # module_0001.SyncTensorsGraph.122
        after = glob.glob(glob.escape(module) + ".*.after_spmd-partitioning*.txt")
        with open(before) as f, open(after[0]) as g:
            best = max(best, (dot_flops(f.read()), dot_flops(g.read())))
    assert best[0], f"no partitioned graph with a dot in {dump}: was XLA_FLAGS set before XLA started?"
    return best[0], best[1], best[1] / best[0]
