"""Which ops torch_xla runs on the CPU (issue 49, ask 4), with torch's own OpInfo database: each entry of ENTRIES runs
SAMPLES of its samples (fp32, forward and backward) on XLA, and the aten:: counters torch_xla grows for an op it has
no lowering for (its CPU fallback) are read before and after. On plain torch_xla and under the trainer's kernels.

    python tests/fallbacks.py plain NAME...    # real torch_xla, SPMD on, none of seamless_tpu's kernels
    python tests/fallbacks.py trainer NAME...  # the same after seamless_tpu.get_device() registered its kernels

NAME is an OpInfo full name (opinfo.full_name). Prints `ENTRY <json>` as each entry ends ({name: outcome}: a crash
loses only the entry it was in) and one RESULT line (child.report) of them all: {name: sorted outcome}, the aten::
counters that grew and, if a sample raised, "raised: <type>" (an op that raises alike on both is no fallback; the
message goes to stderr as "NAME: <type>: <message>").
"""

import json
import sys

import torch
from torch.utils import _pytree as pytree

import child
import opinfo

# op_db's nn.functional.* entries (torch 2.9), written out: the tests collect without importing op_db (2 s, and
# torch.testing._internal), and every child checks the list against op_db, so a torch that adds one fails the tier.
FUNCTIONAL = tuple(f"nn.functional.{name}" for name in (
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "alpha_dropout", "avg_pool1d", "avg_pool2d", "avg_pool3d", "batch_norm",
    "batch_norm.without_cudnn", "bilinear", "binary_cross_entropy", "binary_cross_entropy_with_logits", "celu",
    "channel_shuffle", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "cosine_embedding_loss", "cosine_similarity", "cross_entropy", "ctc_loss", "dropout", "dropout2d", "dropout3d",
    "elu", "embedding", "embedding_bag", "feature_alpha_dropout.with_train", "feature_alpha_dropout.without_train",
    "fractional_max_pool2d", "fractional_max_pool3d", "gaussian_nll_loss", "gelu", "glu", "grid_sample", "group_norm",
    "hardshrink", "hardsigmoid", "hardswish", "hardtanh", "hinge_embedding_loss", "huber_loss", "instance_norm",
    "interpolate.area", "interpolate.bicubic", "interpolate.bilinear", "interpolate.linear", "interpolate.nearest",
    "interpolate.nearest-exact", "interpolate.trilinear", "kl_div", "l1_loss", "layer_norm", "leaky_relu", "linear",
    "local_response_norm", "logsigmoid", "margin_ranking_loss", "max_pool1d", "max_pool2d", "max_pool3d",
    "max_unpool1d", "max_unpool1d.grad", "max_unpool2d", "max_unpool2d.grad", "max_unpool3d", "max_unpool3d.grad",
    "mish", "mse_loss", "multi_head_attention_forward", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "nll_loss", "normalize", "one_hot", "pad.circular", "pad.constant", "pad.reflect",
    "pad.replicate", "pad.replicate_negative", "pairwise_distance", "pdist", "pixel_shuffle", "pixel_unshuffle",
    "poisson_nll_loss", "prelu", "relu", "relu6", "rms_norm", "rrelu", "scaled_dot_product_attention", "selu", "silu",
    "silu.complex", "smooth_l1_loss", "soft_margin_loss", "softmin", "softmin.with_dtype", "softplus", "softshrink",
    "softsign", "tanhshrink", "threshold", "triplet_margin_loss", "triplet_margin_with_distance_loss", "unfold",
    "upsample_bilinear", "upsample_nearest",
))
# The common tensor ops beyond nn.functional.*: the ones whose lowering is least obvious (indices, sorting, scans,
# norms, histograms, outputs shaped by the values), from op_db. With op_db's 115 nn.functional.* entries: 179.
TENSOR_OPS = (
    "scatter", "scatter_add", "scatter_reduce.amax", "scatter_reduce.amin", "scatter_reduce.mean",
    "scatter_reduce.prod", "scatter_reduce.sum", "gather", "take", "take_along_dim", "put",
    "index_add", "index_copy", "index_fill", "index_put", "index_select", "index_reduce.amax", "index_reduce.amin",
    "index_reduce.mean", "index_reduce.prod", "masked_fill", "masked_scatter", "masked_select",
    "sort", "argsort", "topk", "kthvalue", "median", "nanmedian", "mode", "msort",
    "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "logsumexp",
    "norm", "norm.fro", "norm.inf", "norm.nuc", "linalg.vector_norm", "linalg.norm", "renorm",
    "cross", "linalg.cross", "cdist", "searchsorted", "bucketize", "histc", "bincount",
    "unique", "unique_consecutive", "nonzero", "argwhere", "roll", "flip", "rot90", "repeat_interleave", "diff",
    "tril", "triu", "trace", "diag_embed",
)
ENTRIES = sorted(FUNCTIONAL + TENSOR_OPS)
SAMPLES = 4  # per entry: the first two the CPU runs, one from the middle and the last, forward and backward

# Entries whose output's shape depends on the values: XLA compiles static shapes, so torch_xla computes them on the
# CPU (or reads a size to the host), and so does the trainer. A loop keeps them out of its step, or gives a size.
DYNAMIC = (
    "argwhere",  # aten::nonzero: one row per non-zero element
    "bincount",  # aten::bincount: max(input) + 1 bins
    "masked_select",  # aten::masked_select: one element per True in the mask
    "nn.functional.one_hot",  # num_classes=-1 reads max(input) + 1 to the host (aten::_local_scalar_dense)
    "nonzero",  # aten::nonzero: one row per non-zero element
    "repeat_interleave",  # a tensor of repeats (aten::repeat_interleave.Tensor): as long as their sum; the sample
    # gives output_size too, which torch_xla does not use
    "unique",  # aten::_unique2, aten::unique_dim: one element (or slice) per distinct value
    "unique_consecutive",  # aten::unique_consecutive: one element per run of equal values
)
# Entries the trainer still runs partly on the CPU (measured 2026-11-29, SAMPLES samples each): static shapes, no
# lowering yet, in torch_xla or in the trainer. Each names the aten:: counters that grow, and the samples where only
# some do. A lowering that lands takes its entry out: the tier fails while a listed entry no longer falls back.
STILL_ON_CPU = ()  # none since ctc_loss (2026-11-29)


def dtype_of(op):
    """fp32 where the op takes it; an integer dtype for the ops that take integers only (bincount); else None
    (silu.complex)."""
    supported = op.supported_dtypes("cpu")
    return next((t for t in (torch.float32, torch.int64, torch.int32) if t in supported), None)


def run(op, sample, device):
    """The sample's forward on `device` and, where the op is differentiable, the backward of its float outputs' sum.
    Returns what must stay alive until the sync."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    leaves = [t.detach().to(device).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in leaves]
    inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
    out = op(inp, *args, **kwargs)
    diff = [t for t in opinfo.floats(pytree.tree_leaves(sample.output_process_fn_grad(out))) if t.requires_grad]
    if op.supports_autograd and diff:
        sum(t.sum() for t in diff).backward()
    return leaves, out


def select(op):
    """SAMPLES of the samples the CPU runs (forward and backward): the first two (often edges: empty, 0-d, norm's p=0)
    and the rest spread evenly to the last (often the one with every option)."""
    torch.manual_seed(0)  # make_tensor draws from the global generator: both processes see the same values
    dtype = dtype_of(op)
    if dtype is None:
        return []
    runs = []
    for sample in op.sample_inputs("cpu", dtype, requires_grad=op.supports_autograd and dtype.is_floating_point):
        try:  # all of them: ~3 s over ENTRIES' 7,800 samples
            run(op, sample, "cpu")
            runs.append(sample)
        except Exception:  # the CPU itself rejects it: not a sample of the op's contract
            continue
    if len(runs) <= SAMPLES:
        return runs
    return runs[:2] + [runs[k * (len(runs) - 1) // (SAMPLES - 2)] for k in range(1, SAMPLES - 1)]


def outcome(op, met, device):
    """The aten:: counters the entry's samples grow on `device`, and "raised: <type>" for a sample that raises."""
    import torch_xla

    def counters():
        return {k: met.counter_value(k) for k in met.counter_names() if k.startswith("aten::")}

    samples = select(op)
    before, raised = counters(), set()
    for sample in samples:
        try:
            alive = run(op, sample, device)
            torch_xla.sync()
            del alive
        except Exception as e:  # the outcome says only its type, alike on both when both raise
            raised.add(f"raised: {type(e).__name__}")
            print(f"{opinfo.full_name(op)}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
    after = counters()
    grew = {k for k, v in after.items() if v > before.get(k, 0)}
    return sorted(grew | raised) if samples else ["skipped: the CPU runs none of its samples in fp32 or integers"]


if __name__ == "__main__":
    import torch_xla.debug.metrics as met

    mode, names = sys.argv[1], sys.argv[2:]
    device = opinfo.xla_device(mode)
    from torch.testing._internal.common_methods_invocations import op_db

    ops = {opinfo.full_name(op): op for op in op_db}
    assert set(FUNCTIONAL) == {name for name in ops if name.startswith("nn.functional.")}, "op_db changed"
    assert set(TENSOR_OPS) <= set(ops), set(TENSOR_OPS) - set(ops)
    done = {}
    for name in names:
        done[name] = outcome(ops[name], met, device)
        print("ENTRY " + json.dumps({name: done[name]}), flush=True)
    child.report(done)
