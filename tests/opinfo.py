"""The trainer's XLA kernels against torch's contracts (issue 39), with torch's own OpInfo database: each kernel and
F patch of seamless_tpu is exercised by the OpInfo entries of OPINFO_NAMES, and each entry's samples run on XLA and on
the CPU (the reference), comparing the forward (values, shape, dtype), the gradient, the second gradient and vmap.

    python tests/opinfo.py plain NAME...    # real torch_xla, SPMD on, none of seamless_tpu's kernels
    python tests/opinfo.py trainer NAME...  # the same after seamless_tpu.get_device() registered its kernels

NAME is an OpInfo full name (name.variant, e.g. nn.functional.interpolate.bilinear). Reports one RESULT line
(child.report): {name: [[sample index, sample summary, status], ...]}, status "ok", "skipped: ..." (the CPU itself
rejects the sample) or the sample's first failure. GROUPS splits the names a few to a process. A value off by more
than TOL is still "ok" when it is no farther from the sample's float64 answer than twice the CPU's float32 one.
"""

import copy
import os
import sys

import torch
from torch.utils import _pytree as pytree

import child
import seamless_tpu

# Which OpInfo entries reach each of seamless_tpu's lowerings (_LOWERINGS: its kernels, and the functions it patches
# in F; einsum: torch_xla's own lowering, whose backward has no second derivative). op_db has no fold entry: col2im is
# unfold's backward on plain torch_xla, so unfold's first and second gradients reach it. No bmm: aten::bmm never
# reaches the matmul kernel. 1-D adaptive and max pooling and mode="area" are the 2-D and 3-D kernels underneath.
OPINFO_NAMES = {
    "matmul": ["matmul", "nn.functional.linear", "nn.functional.scaled_dot_product_attention"],
    "linear": ["nn.functional.linear"],
    "layer_norm": ["nn.functional.layer_norm"],
    "group_norm": ["nn.functional.group_norm"],
    "batch_norm": ["nn.functional.batch_norm", "nn.functional.instance_norm"],
    "adaptive_avg_pool2d": ["nn.functional.adaptive_avg_pool1d", "nn.functional.adaptive_avg_pool2d",
                            "nn.functional.interpolate.area"],
    "adaptive_avg_pool3d": ["nn.functional.adaptive_avg_pool3d", "nn.functional.interpolate.area"],
    "upsample_nearest1d.vec": ["nn.functional.interpolate.nearest"],
    "upsample_nearest2d.vec": ["nn.functional.interpolate.nearest", "nn.functional.upsample_nearest"],
    "upsample_nearest3d.vec": ["nn.functional.interpolate.nearest"],
    "upsample_linear1d.vec": ["nn.functional.interpolate.linear"],
    "upsample_bilinear2d.vec": ["nn.functional.interpolate.bilinear", "nn.functional.upsample_bilinear"],
    "upsample_trilinear3d.vec": ["nn.functional.interpolate.trilinear"],
    "upsample_bicubic2d.vec": ["nn.functional.interpolate.bicubic"],
    "_upsample_nearest_exact1d.vec": ["nn.functional.interpolate.nearest-exact"],
    "_upsample_nearest_exact2d.vec": ["nn.functional.interpolate.nearest-exact"],
    "_upsample_nearest_exact3d.vec": ["nn.functional.interpolate.nearest-exact"],
    "conv1d": ["nn.functional.conv1d"],
    "conv2d": ["nn.functional.conv2d"],
    "conv3d": ["nn.functional.conv3d"],
    "glu": ["nn.functional.glu"],
    "channel_shuffle": ["nn.functional.channel_shuffle"],
    "grid_sampler": ["nn.functional.grid_sample"],
    "im2col": ["nn.functional.unfold"],
    "col2im": ["nn.functional.unfold"],
    "adaptive_max_pool2d": ["nn.functional.adaptive_max_pool1d", "nn.functional.adaptive_max_pool2d"],
    "kl_div": ["nn.functional.kl_div"],
    "multi_head_attention_forward": ["nn.functional.multi_head_attention_forward"],
    "embedding_bag": ["nn.functional.embedding_bag"],
    "einsum": ["einsum"],
    "addmm": ["addmm", "addmm.decomposed", "nn.functional.linear"],
    "index_put_": ["index_put"],
    "index_put": ["index_put"],
    "avg_pool2d": ["nn.functional.avg_pool1d", "nn.functional.avg_pool2d"],
    "avg_pool2d_backward": ["nn.functional.avg_pool1d", "nn.functional.avg_pool2d"],
    "avg_pool3d": ["nn.functional.avg_pool3d"],
    "avg_pool3d_backward": ["nn.functional.avg_pool3d"],
    "adaptive_max_pool3d": ["nn.functional.adaptive_max_pool3d"],
    "_cdist_forward": ["cdist"],
    "_cdist_backward": ["cdist"],
    "_pdist_forward": ["nn.functional.pdist"],
    "_pdist_backward": ["nn.functional.pdist"],
    "fractional_max_pool2d": ["nn.functional.fractional_max_pool2d"],
    "fractional_max_pool3d": ["nn.functional.fractional_max_pool3d"],
    "linalg_cross": ["linalg.cross", "cross"],
    "huber_loss": ["nn.functional.huber_loss"],
    "huber_loss_backward": ["nn.functional.huber_loss"],
    "_logcumsumexp": ["logcumsumexp"],
    "norm.ScalarOpt_dim": ["norm"],
    "multi_margin_loss": ["nn.functional.multi_margin_loss"],
    "multi_margin_loss_backward": ["nn.functional.multi_margin_loss"],
    "multilabel_margin_loss_forward": ["nn.functional.multilabel_margin_loss"],
    "multilabel_margin_loss_backward": ["nn.functional.multilabel_margin_loss"],
    "searchsorted.Tensor": ["searchsorted"],
    "searchsorted.Scalar": ["searchsorted"],
    "bucketize.Tensor": ["bucketize"],
    "bucketize.Scalar": ["bucketize"],
    "median.dim": ["median"],
    "nanmedian.dim": ["nanmedian"],
    "median": ["median"],
    "nanmedian": ["nanmedian"],
    "mode": ["mode"],
    "histc": ["histc"],
    "scatter_reduce.two": ["scatter_reduce.sum", "scatter_reduce.prod", "scatter_reduce.mean", "scatter_reduce.amin",
                           "scatter_reduce.amax"],
    "gaussian_nll_loss": ["nn.functional.gaussian_nll_loss"],
    "rrelu": ["nn.functional.rrelu"],
    "rrelu_": ["nn.functional.rrelu"],
    "nll_loss": ["nn.functional.nll_loss", "nn.functional.cross_entropy"],
    "roll": ["roll"],
    "renorm": ["renorm"],
    "cummin": ["cummin"],
    "index_reduce": ["index_reduce.prod", "index_reduce.mean", "index_reduce.amax", "index_reduce.amin"],
    "max_pool2d": ["nn.functional.max_pool2d"],
    "max_pool2d_with_indices": ["nn.functional.max_pool1d", "nn.functional.max_pool2d"],
    "max_pool2d_with_indices_backward": ["nn.functional.max_pool1d", "nn.functional.max_pool2d"],
    "max_pool3d": ["nn.functional.max_pool3d"],
    "max_pool3d_with_indices": ["nn.functional.max_pool3d"],
    "max_pool3d_with_indices_backward": ["nn.functional.max_pool3d"],
    "index_fill.int_Tensor": ["index_fill"],
    "masked_scatter_backward": ["masked_scatter"],
    "ctc_loss.IntList": ["nn.functional.ctc_loss"],
    "ctc_loss.Tensor": ["nn.functional.ctc_loss"],
    "slice_copy.Tensor": ["slice", "narrow", "__getitem__"],
    "slice_scatter": ["slice_scatter"],
    "slice_backward": ["slice", "narrow", "__getitem__"],
    "_grouped_mm": ["_grouped_mm"],  # op_db has none: own_entries()
}
NAMES = sorted({name for op in seamless_tpu._LOWERINGS for name in OPINFO_NAMES.get(op, ())})  # the table's
N_GROUPS = 4  # every process pays ~10 s to import torch, torch_xla and op_db; round-robin spreads the heavy entries
GROUPS = {f"g{i}": NAMES[i::N_GROUPS] for i in range(N_GROUPS)}

PRECISION_VAR = "SEAMLESS_TPU_TEST_MATMUL_PRECISION"  # set: torch_xla.backends.set_mat_mul_precision(its value)
SAMPLES = 10  # per entry, spread evenly over its samples (unfold's first 81 are all one empty batch)
TOL = {"forward": 1e-5, "grad": 1e-5, "gradgrad": 1e-4, "vmap": 1e-5}  # rtol and atol, fp32


def full_name(op):
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def without_dropout(name, sample):
    """Dropout draws from each device's own generator, so a sample with a dropout probability is taken with p=0 (the
    rest of the op is still compared): SDPA's dropout_p, MHA's (its only sample has 0.5 in training). rrelu in
    training draws its slopes so too: its range is narrowed to its middle, uniform(m, m), one slope."""
    if "dropout_p" in sample.kwargs:
        sample.kwargs["dropout_p"] = 0.0
    if name == "nn.functional.rrelu" and sample.kwargs.get("training"):
        middle = (sample.kwargs.get("lower", 1 / 8) + sample.kwargs.get("upper", 1 / 3)) / 2
        sample.kwargs.update(lower=middle, upper=middle)
    if name == "nn.functional.multi_head_attention_forward":
        sample.args = sample.args[:9] + (0.0,) + sample.args[10:]  # query is the input; dropout_p is argument 10
    return sample


def summary(sample):
    """Dtypes and shapes, and the other arguments: "float32[2, 3, 4] ((3,),) {mode: area}"."""
    def show(x):
        return f"{str(x.dtype)[6:]}{list(x.shape)}" if isinstance(x, torch.Tensor) else x
    shown = pytree.tree_map(show, (sample.input, sample.args, sample.kwargs))
    return f"{shown[0]} {shown[1]} {shown[2]}".replace("'", "")[:200]


def select(name, op):
    """At most SAMPLES distinct samples of the entry, spread evenly, then its EXTRA ones: [(index, sample)]."""
    torch.manual_seed(0)  # make_tensor draws from the global generator: both processes see the same values
    seen, distinct = set(), []
    for i, sample in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=True)):
        sample = without_dropout(name, sample)
        if summary(sample) not in seen:  # SDPA's p=0.5 twins are alike once their dropout is off
            seen.add(summary(sample))
            distinct.append((i, sample))
    picked = [distinct[k * len(distinct) // SAMPLES] for k in range(SAMPLES)] if len(distinct) > SAMPLES else distinct
    return picked + [(f"extra{k}", sample) for k, sample in enumerate(EXTRA.get(name, lambda op: [])(op))]


def _mode_ties(op):
    """op_db's mode #6 with ties, as torch_xla's own test_ops.py draws it on the XLA device (issue 60): 3000 values,
    5 distinct; torch's CPU kernel names the index its std::sort leaves last among the mode's (the CPU draw of #6 has
    no ties, so any index of a unique minimum passes)."""
    from torch.testing._internal.opinfo.core import SampleInput

    ties = torch.randint(0, 5, (3000,), generator=torch.Generator().manual_seed(0)).float()
    return [SampleInput(ties.requires_grad_())]


def _bag_max_last_offset(op):
    """op_db's embedding_bag samples with mode="max" and include_last_offset=True, the sample torch_xla's test_ops.py
    names under the trainer (issue 60: its fallback check, the values were the CPU's), which SAMPLES skips."""
    return [sample for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True)
            if sample.kwargs.get("mode") == "max" and sample.kwargs.get("include_last_offset")]


# Samples beyond SAMPLES of op_db's: torch_xla's own suite named them (issue 60). {OpInfo full name: op -> samples}
EXTRA = {"mode": _mode_ties, "nn.functional.embedding_bag": _bag_max_last_offset}


def _grouped_mm_samples(op, device, dtype, requires_grad, **kwargs):
    """torch._grouped_mm's forms (transformers' MoE experts): rows, K or columns split by int32 offsets, one group
    empty, and a batch of products (K and N of 8 and 16: torch's kernel asks 16-byte strides)."""
    from torch.testing._internal.opinfo.core import SampleInput

    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(requires_grad)

    def ends(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)
    return [SampleInput(t(12, 8), t(4, 8, 8), offs=ends(3, 3, 9, 12)),
            SampleInput(t(8, 16), t(16, 8), offs=ends(3, 3, 9, 16)),
            SampleInput(t(4, 8, 8), t(8, 16), offs=ends(4, 8, 12, 16)), SampleInput(t(4, 8, 8), t(4, 8, 8))]


def own_entries():
    """OpInfo entries of ops the trainer lowers that op_db lacks: {full name: OpInfo}."""
    from torch.testing._internal.opinfo.core import OpInfo

    return {"_grouped_mm": OpInfo("_grouped_mm", op=torch._grouped_mm, dtypes=(torch.float32, torch.bfloat16),
                                  sample_inputs_func=_grouped_mm_samples, supports_out=False)}


def fixed_like(t, seed):
    """A fixed random tensor shaped like t, drawn on the CPU: the same cotangents on both devices (and in float64)."""
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(t.dtype)


def in_float64(sample):
    """The sample with its float32 tensors in float64: the answer a float32 result's rounding is measured from."""
    def double(t):
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            return t.detach().double().requires_grad_(t.requires_grad)
        return t
    sample.input, sample.args, sample.kwargs = pytree.tree_map(double, (sample.input, sample.args, sample.kwargs))
    return sample


def as_rounded(stage, xs, refs, exact):
    """Each of xs is no farther from the float64 answer (exact) than twice the CPU's own float32 result (refs) is, and
    within the tolerance's own atol: where float32 rounding decides the answer (logcumsumexp of values near 1e4, whose
    gradient the CPU itself gets only to 5e-4), a kernel on the device cannot repeat the CPU's roundings."""
    for x, ref, e in zip(xs, refs, exact):
        if not (x.is_floating_point() and e.is_floating_point()) or x.shape != e.shape:
            return False
        e = e.detach().double()
        ours, cpus = ((t.detach().cpu().double() - e).abs().nan_to_num(0).max().item() if e.numel() else 0.0
                      for t in (x, ref))
        if ours > 2 * cpus + TOL[stage] * max(1.0, e.abs().max().item() if e.numel() else 1.0):
            return False
    return True


def floats(tensors):
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]


def run(op, sample, device):
    """The sample on `device`: {stage: tensors or an exception} for forward, grad, gradgrad and vmap; a stage missing
    is one the op does not support. The tensors stay on `device` (one XLA graph a sample)."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    leaves = [t.detach().to(device).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in leaves]

    def call(leaves):
        inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
        return [t for t in pytree.tree_leaves(op(inp, *args, **kwargs)) if isinstance(t, torch.Tensor)]

    out = {}
    try:
        outputs = call(leaves)
        out["forward"] = outputs
        inputs = [t for t in floats(leaves) if t.requires_grad]
        if op.supports_autograd and inputs:
            diff = [t for t in floats(pytree.tree_leaves(sample.output_process_fn_grad(outputs))) if t.requires_grad]
            # the cotangents take part in the second gradient, as in gradgradcheck: the gradient of a linear op
            # (pooling, a convolution's input) is linear in them, and a gradient penalty differentiates through that
            cots = [fixed_like(t, i).to(device).requires_grad_(op.supports_gradgrad) for i, t in enumerate(diff)]
            grads = torch.autograd.grad(diff, inputs, cots, allow_unused=True, create_graph=op.supports_gradgrad)
            out["grad"] = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
            if op.supports_gradgrad:  # (grads . fixed vectors) differentiated again; a gradient without a graph
                # counts as a constant, so a missing graph shows only where the CPU's second derivative is not zero
                out["has_graph"] = [g is not None and g.requires_grad for g in grads]
                pairs = [(g, fixed_like(g, 100 + i).to(device)) for i, g in enumerate(grads) if out["has_graph"][i]]
                again = torch.autograd.grad([g for g, _ in pairs], inputs + cots, [v for _, v in pairs],
                                            allow_unused=True) if pairs else [None] * len(inputs + cots)
                out["gradgrad"] = [torch.zeros_like(x) if g is None else g for g, x in zip(again, inputs + cots)]
    except Exception as e:  # the stage reached so far keeps its result; the first to raise says why
        out[next(s for s in ("forward", "grad", "gradgrad") if s not in out)] = e
    # vmap over a batch of two: the first floating input and a perturbed copy, stacked on dim 0
    first = next((k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    if first is not None and not isinstance(out.get("forward"), Exception):
        x = leaves[first].detach()
        batch = torch.stack([x, x + 0.1 * fixed_like(x, 200).to(device)])
        try:
            out["vmap"] = torch.func.vmap(lambda x: call(leaves[:first] + [x] + leaves[first + 1:]))(batch)
        except Exception as e:
            out["vmap"] = e
    return out


def why(e):
    return f"raises: {type(e).__name__}: {str(e).strip()[:200]}"


def differ(stage, xs, refs):
    """The first way tensors xs differ from the CPU's refs, or None."""
    if len(xs) != len(refs):
        return f"{stage}: {len(xs)} tensors vs {len(refs)}"
    for x, ref in zip(xs, refs):
        x = x.detach().cpu()
        if x.shape != ref.shape:
            return f"{stage} shape {tuple(x.shape)} vs {tuple(ref.shape)}"
        if x.dtype != ref.dtype:
            return f"{stage} dtype {x.dtype} vs {ref.dtype}"
        ref = ref.detach()
        # atol scales with the reference's largest magnitude (at least 1): an element near 0 of a gradient in the
        # hundreds carries the rounding of the hundreds; "off by" is the largest difference over that scale
        scale = max(1.0, ref.abs().max().item()) if ref.numel() and ref.is_floating_point() else 1.0
        if not torch.allclose(x, ref, rtol=TOL[stage], atol=TOL[stage] * scale, equal_nan=True):
            off = (x.double() - ref.double()).abs().nan_to_num(float("inf")).max().item() / scale
            return f"{stage} off by {off:.2g}"
    return None


# Samples that kill plain torch_xla 2.9's process, which the trainer lowers instead (issue 49, ask 6): on plain
# torch_xla they are not run (their status says why), so that one sample does not cost its group.
CRASHES = {"roll": (lambda sample: sample.input.numel() == 0, "crashes: SIGFPE (an empty tensor)"),
           "nn.functional.nll_loss": (lambda sample: sample.input.dim() == 1, "crashes: SIGSEGV (unbatched input)"),
           "nn.functional.cross_entropy": (lambda sample: sample.input.dim() == 1, "crashes: SIGSEGV (unbatched)"),
           "_grouped_mm": (lambda sample: True, "crashes: SIGSEGV (torch's CPU kernel reads XLA tensors' memory)")}


def status(op, sample, device, mode="trainer"):
    import torch_xla

    crashes, said = CRASHES.get(full_name(op), (lambda sample: False, None))
    if mode == "plain" and crashes(sample):
        return said
    try:
        ref = run(op, sample, "cpu")
    except Exception as e:
        return f"skipped: the CPU {why(e)}"
    if isinstance(ref["forward"], Exception):
        return f"skipped: the CPU {why(ref['forward'])}"
    try:
        got = run(op, sample, device)
        torch_xla.sync()
    except Exception as e:
        return why(e)
    exact = None  # the sample in float64 on the CPU, run when a float32 result differs
    for stage in ("forward", "grad", "gradgrad", "vmap"):
        if stage not in ref or isinstance(ref[stage], Exception):
            continue  # the op does not support it, or the CPU itself raises: nothing to compare with
        if stage not in got:
            return f"{stage} missing"
        if isinstance(got[stage], Exception):
            return f"{stage} {why(got[stage])}"
        try:
            wrong = differ(stage, got[stage], ref[stage])
        except Exception as e:  # the graph ran only now, at the transfer
            return f"{stage} {why(e)}"
        if wrong and stage == "gradgrad" and sum(got["has_graph"]) < sum(ref["has_graph"]):
            return "no second derivative"  # torch_xla's einsum backward, a C++ function autograd cannot differentiate
        if wrong and wrong.startswith(f"{stage} off by") and stage != "vmap":  # values only: shapes, dtypes match
            exact = exact or run(op, in_float64(copy.copy(sample)), "cpu")
            if isinstance(exact.get(stage), list) and as_rounded(stage, got[stage], ref[stage], exact[stage]):
                wrong = None
        if wrong:
            return wrong
    return "ok"


def xla_device(mode):
    """The XLA device of a child: "trainer" once seamless_tpu registered its kernels and patches (each checked, so
    the run compares the trainer's, not torch_xla's again), "plain" torch_xla with SPMD on; then a first op on it."""
    import torch_xla
    import torch_xla.runtime as xr

    if mode == "trainer":
        assert os.environ.get("SEAMLESS_TPU_DEVICE") == "xla"
        torchs = torch.nn.functional.multi_head_attention_forward, torch.nn.functional.embedding_bag
        device = seamless_tpu.get_device()  # registers the kernels and patches, switches SPMD on
        assert all(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", lowering.key)
                   for op, lowering in seamless_tpu._LOWERINGS.items() if not lowering.functional)
        assert torchs[0] is not torch.nn.functional.multi_head_attention_forward
        assert torchs[1] is not torch.nn.functional.embedding_bag
    else:
        assert mode == "plain", mode
        xr.use_spmd()
        device = torch_xla.device()
    if os.environ.get(PRECISION_VAR):  # issue 60: the products' dots at torch_xla's matmul precision
        import torch_xla.backends

        torch_xla.backends.set_mat_mul_precision(os.environ[PRECISION_VAR])
    # before any CPU backward: one run first on the CPU broke every later XLA backward in the process
    torch.zeros(1, device=device).add_(1)
    torch_xla.sync()
    return device


if __name__ == "__main__":
    mode, names = sys.argv[1], sys.argv[2:]
    device = xla_device(mode)
    from torch.testing._internal.common_methods_invocations import op_db

    ops = {**{full_name(op): op for op in op_db}, **own_entries()}
    child.report({name: [[i, summary(sample), status(ops[name], sample, device, mode)]
                         for i, sample in select(name, ops[name])] for name in names})
