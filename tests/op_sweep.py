"""Whole op families keep the batch split (issue 33): every torch.nn layer class that takes a batch, and the common
functional losses, each placed between two matmul layers (so work lost at the layer shows in the FLOPs after it),
trained through SeamlessTPUTrainer on 4 virtual XLA devices with "ddp" and "fsdp", read from the partitioned HLO.

    python tests/op_sweep.py eager GROUP   # each case's losses and final weights and buffers (a process without XLA)
    python tests/op_sweep.py GROUP         # on XLA: the same, plus matmul+convolution FLOPs per device and gathers
    python tests/op_sweep.py unfixed       # the UNet on XLA with torch_xla's own group_norm: what the check sees

GROUPS splits the cases a few to a process (one process trains many models: SPMD is one-way, not per model). Each
run reports one RESULT line (child.report).
"""

import logging
import os
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import child
import work_split

B, C, S, T, E, V = 8, 8, 8, 6, 16, 20  # batch, channels, image side, sequence, features, vocabulary
STEPS, LR = 3, 0.1  # plain SGD: one compiled graph a case, and the weights carry each step's gradients


class Between(nn.Module):
    """pre -> layer -> post: the work after `layer` runs whole if the layer lost the batch split."""

    def __init__(self, pre, layer, post, call=None):
        super().__init__()
        self.pre, self.layer, self.post, self.call = pre, layer, post, call

    def forward(self, x):
        h = self.pre(x)
        h = self.call(self.layer, h) if self.call else self.layer(h)
        return self.post(h)


def image(layer, dims=2, out=C, call=None):
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    return Between(conv(4, C, 3, padding=1), layer, conv(out, C, 1), call), (B, 4) + (S if dims < 3 else 4,) * dims


def seq(layer, call=None, post=E):
    return Between(nn.Linear(E, E), layer, nn.Linear(post, E), call), (B, T, E)


def seq_first(layer, call=None):
    """A (T, B, E) model around a seq-first layer: the trainer infers batch_dim=1 from it, as from the user's own."""
    return Between(nn.Linear(E, E), layer, nn.Linear(E, E), call), (T, B, E)


def first(layer, h):  # layers that return (output, state) or (output, weights)
    return layer(h)[0]


class Cells(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, h):
        state, outs = None, []
        for t in range(h.shape[1]):
            state = self.cell(h[:, t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs, 1)


class Unpool(nn.Module):
    def forward(self, h):
        return F.max_unpool2d(*F.max_pool2d(h, 2, return_indices=True), 2)


class FoldBack(nn.Module):
    def forward(self, h):
        return F.fold(F.unfold(h, 2, stride=2) * 2, (S, S), 2, stride=2)


class Sdpa(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, h):
        q = k = v = h.unflatten(-1, (2, -1)).transpose(1, 2)  # (B, heads, T, d)
        if self.mask == "causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
            keep = torch.ones(T, T, dtype=torch.bool, device=h.device)
            keep[:, -2:] = False  # the last two keys padded: not the causal mask (whose graph XLA has cached)
            mask = keep if self.mask == "bool" else torch.zeros(T, T, device=h.device).masked_fill(~causal, -1e4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).flatten(2)


class Warp(nn.Module):
    """A spatial transformer's sampling: F.grid_sample at the affine grid of a learned transform."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([[0.9, 0.1, 0.05], [-0.1, 0.9, 0.0]]))

    def forward(self, h):
        return F.grid_sample(h, F.affine_grid(self.theta.expand(len(h), 2, 3), h.shape, align_corners=False),
                             align_corners=False)


class Warp3d(nn.Module):
    """Warp's volume sampling: a 5-D input at the affine grid of a learned 3-D transform."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([[0.9, 0.1, 0.0, 0.05], [-0.1, 0.9, 0.0, 0.0], [0.0, 0.1, 0.9, 0.0]]))

    def forward(self, h):
        return F.grid_sample(h, F.affine_grid(self.theta.expand(len(h), 3, 4), h.shape, align_corners=False),
                             align_corners=False)


class Bucketed(nn.Module):
    """Activations bucketed into fixed boundaries, the buckets used as an index: an embedding (bucketize of each
    position's mean) or a gather of a learned scale per bucket (searchsorted of each value)."""

    def __init__(self, search):
        super().__init__()
        self.search = search
        self.register_buffer("bounds", torch.tensor([-0.5, -0.1, 0.1, 0.5]), persistent=False)
        self.emb, self.scale = nn.Embedding(5, E), nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, h):
        if self.search:
            at = torch.searchsorted(self.bounds, h.contiguous(), right=True)
            return h * self.scale.expand(*h.shape[:-1], 5).gather(-1, at)
        return h + self.emb(torch.bucketize(h.mean(-1), self.bounds))


class Pairwise(nn.Module):
    """torch.cdist between two projections of the batch: (B, T, E) x (B, T, E) -> (B, T, T)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, h):
        return torch.cdist(self.q(h), self.k(h))


class Bags(nn.Module):
    """F.embedding_bag of 1-D indices with offsets: the (B, 3) ids flattened, in bags of 1 to 5 (the last holds the
    rest), `mode`, and with "sum" fixed per-index weights."""

    def __init__(self, mode):
        super().__init__()
        self.bag, self.mode = nn.EmbeddingBag(V, E, mode=mode), mode
        self.register_buffer("offsets", torch.tensor([0, 2, 3, 6, 10, 12, 17, 20]), persistent=False)

    def forward(self, x):
        ids = x.flatten()
        weights = torch.linspace(0.5, 1.5, len(ids), device=x.device) if self.mode == "sum" else None
        return self.bag(ids, self.offsets, per_sample_weights=weights)


def fn(f, post=E):
    """f(h) between two Linear layers on (B, T, E): an op used inside a model."""
    return seq(nn.Identity(), call=lambda _, h: f(h), post=post)


def bucket(h, reduce):
    """Each position's 16 features reduced into 4 buckets (feature i into bucket i % 4), shape (B, T, 4)."""
    at = torch.arange(E, device=h.device) % 4
    if reduce == "amax":
        return h.new_zeros(*h.shape[:-1], 4).scatter_reduce(-1, at.expand(h.shape), h, "amax", include_self=False)
    with warnings.catch_warnings():  # torch's, once a process: what the sweep checks is the trainer's and XLA's
        warnings.filterwarnings("ignore", r"index_reduce\(\) is in beta")
        return h.new_zeros(*h.shape[:-1], 4).index_reduce(-1, at, h, reduce, include_self=False)


def cross(h):
    a = h[..., :15].unflatten(-1, (5, 3))  # five 3-vectors a position, each crossed with another
    return torch.linalg.cross(a, a.flip(-2)).flatten(-2)


class ResBlock(nn.Module):
    """A diffusion UNet's residual block: GroupNorm, SiLU, convolution, twice, plus the input."""

    def __init__(self, c):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))


class UNet(nn.Module):
    """The smallest diffusion-style UNet: repeated GroupNorm blocks (which the trainer marks), a strided down
    convolution, a nearest upsample and a skip connection."""

    def __init__(self):
        super().__init__()
        self.inp, self.down, self.out = nn.Conv2d(4, C, 3, padding=1), nn.Conv2d(C, C, 3, 2, 1), nn.Conv2d(2 * C, 4, 1)
        self.enc = nn.Sequential(ResBlock(C), ResBlock(C))
        self.mid = nn.Sequential(ResBlock(C), ResBlock(C))
        self.up = nn.Upsample(scale_factor=2)

    def forward(self, x):
        skip = self.enc(self.inp(x))
        return self.out(torch.cat([self.up(self.mid(self.down(skip))), skip], 1))


def cases():
    """name -> a builder of (model, input shape[, loss of (output, target)]; default: the output's mean square)."""
    return {
        # convolutions and transposed convolutions
        "conv1d": lambda: image(nn.Conv1d(C, C, 3, padding=1), 1),
        "conv2d": lambda: image(nn.Conv2d(C, C, 3, padding=1)),
        "conv2d_grouped": lambda: image(nn.Conv2d(C, C, 3, padding=1, groups=4)),
        "conv3d": lambda: image(nn.Conv3d(C, C, 3, padding=1), 3),
        "conv_transpose1d": lambda: image(nn.ConvTranspose1d(C, C, 4, stride=2, padding=1), 1),
        "conv_transpose2d": lambda: image(nn.ConvTranspose2d(C, C, 4, stride=2, padding=1)),
        "conv_transpose3d": lambda: image(nn.ConvTranspose3d(C, C, 4, stride=2, padding=1), 3),
        # normalizations
        "batch_norm1d": lambda: image(nn.BatchNorm1d(C), 1),
        "batch_norm2d": lambda: image(nn.BatchNorm2d(C)),
        "batch_norm3d": lambda: image(nn.BatchNorm3d(C), 3),
        "group_norm": lambda: image(nn.GroupNorm(4, C)),
        "group_norm_1d": lambda: image(nn.GroupNorm(2, C), 1),
        "instance_norm1d": lambda: image(nn.InstanceNorm1d(C, affine=True, track_running_stats=True), 1),
        "instance_norm2d": lambda: image(nn.InstanceNorm2d(C, affine=True, track_running_stats=True)),
        "instance_norm3d": lambda: image(nn.InstanceNorm3d(C), 3),
        "local_response_norm": lambda: image(nn.LocalResponseNorm(3)),
        "layer_norm_chw": lambda: image(nn.LayerNorm([C, S, S])),
        "layer_norm": lambda: seq(nn.LayerNorm(E)),
        "rms_norm": lambda: seq(nn.RMSNorm(E)),
        # pooling and adaptive pooling
        "max_pool1d": lambda: image(nn.MaxPool1d(2), 1),
        "max_pool2d": lambda: image(nn.MaxPool2d(3, stride=2, padding=1)),
        "max_pool3d": lambda: image(nn.MaxPool3d(2), 3),
        "avg_pool1d": lambda: image(nn.AvgPool1d(2), 1),
        "avg_pool2d": lambda: image(nn.AvgPool2d(3, stride=2, padding=1)),
        "avg_pool3d": lambda: image(nn.AvgPool3d(2), 3),
        "lp_pool2d": lambda: image(nn.LPPool2d(2, 2)),
        "adaptive_avg_pool1d": lambda: image(nn.AdaptiveAvgPool1d(3), 1),
        "adaptive_avg_pool2d": lambda: image(nn.AdaptiveAvgPool2d(3)),
        "adaptive_avg_pool3d": lambda: image(nn.AdaptiveAvgPool3d(3), 3),
        "adaptive_max_pool2d": lambda: image(nn.AdaptiveMaxPool2d(3)),
        "max_unpool2d": lambda: image(Unpool()),
        # resampling and rearranging
        "upsample_nearest": lambda: image(nn.Upsample(scale_factor=2)),
        "upsample_nearest_exact": lambda: image(nn.Upsample(scale_factor=2, mode="nearest-exact")),
        "upsample_bilinear": lambda: image(nn.Upsample(scale_factor=2, mode="bilinear")),
        "upsample_linear1d": lambda: image(nn.Upsample(scale_factor=2, mode="linear"), 1),
        "upsample_trilinear": lambda: image(nn.Upsample(scale_factor=2, mode="trilinear"), 3),
        "interpolate_bicubic": lambda: image(nn.Identity(), call=lambda _, h: F.interpolate(h, size=(11, 11),
                                                                                           mode="bicubic")),
        "grid_sample": lambda: image(Warp()),
        "pixel_shuffle": lambda: image(nn.PixelShuffle(2), out=C // 4),
        "channel_shuffle": lambda: image(nn.ChannelShuffle(4)),
        "pixel_unshuffle": lambda: image(nn.PixelUnshuffle(2), out=4 * C),
        "fold_unfold": lambda: image(FoldBack()),
        "reflection_pad2d": lambda: image(nn.ReflectionPad2d(1)),
        "replication_pad2d": lambda: image(nn.ReplicationPad2d(1)),
        # embeddings
        "embedding_bag_mean": lambda: (Between(nn.Identity(), nn.EmbeddingBag(V, E), nn.Linear(E, E)), "ids"),
        "embedding_bag_max": lambda: (Between(nn.Identity(), nn.EmbeddingBag(V, E, mode="max"), nn.Linear(E, E)),
                                      "ids"),
        "embedding": lambda: (Between(nn.Identity(), nn.Embedding(V, E), nn.Linear(E, E)), "ids"),
        # recurrent cells and layers
        "rnn_cell": lambda: seq(Cells(nn.RNNCell(E, E))),
        "lstm_cell": lambda: seq(Cells(nn.LSTMCell(E, E))),
        "gru_cell": lambda: seq(Cells(nn.GRUCell(E, E))),
        "lstm": lambda: seq(nn.LSTM(E, E, 2, batch_first=True), first),
        "gru_seq_first": lambda: seq_first(nn.GRU(E, E), first),
        "rnn_bidirectional": lambda: seq(nn.RNN(E, E, batch_first=True, bidirectional=True), first, post=2 * E),
        # attention and transformer layers
        "multihead_attention": lambda: seq(nn.MultiheadAttention(E, 2, batch_first=True),
                                           lambda m, h: m(h, h, h, need_weights=False)[0]),
        "multihead_attention_seq_first": lambda: seq_first(nn.MultiheadAttention(E, 2),
                                                           lambda m, h: m(h, h, h, need_weights=False)[0]),
        "transformer_encoder_layer": lambda: seq(nn.TransformerEncoderLayer(E, 2, 2 * E, 0.0, batch_first=True)),
        "transformer_decoder_layer": lambda: seq(nn.TransformerDecoderLayer(E, 2, 2 * E, 0.0, batch_first=True),
                                                 lambda m, h: m(h, h)),
        "transformer": lambda: seq_first(nn.Transformer(E, 2, 1, 1, 2 * E, 0.0), lambda m, h: m(h, h)),
        "sdpa_causal": lambda: seq(Sdpa("causal")),
        "sdpa_bool_mask": lambda: seq(Sdpa("bool")),
        "sdpa_float_mask": lambda: seq(Sdpa("float")),
        # a model of them
        "unet": lambda: (UNet(), (B, 4, S, S)),
        # functional losses
        "kl_div": lambda: (*seq(nn.Identity()), lambda out, target: F.kl_div(
            out.log_softmax(-1), target.softmax(-1), reduction="batchmean")),
        "kl_div_log_target": lambda: (*seq(nn.Identity()), lambda out, target: F.kl_div(
            out.log_softmax(-1), target.log_softmax(-1), reduction="batchmean", log_target=True)),
        "glu": lambda: seq(nn.GLU(), post=E // 2),
        "cross_entropy_smoothed": lambda: (*seq(nn.Identity()), lambda out, target: F.cross_entropy(
            out.transpose(1, 2), target.argmax(-1), label_smoothing=0.1)),
        # issue 49's lowerings: losses
        "huber_loss": lambda: (*seq(nn.Identity()), lambda out, target: F.huber_loss(out, target, delta=0.5)),
        "multi_margin_loss": lambda: (*seq(nn.Identity()), lambda out, target: F.multi_margin_loss(
            out.flatten(0, 1), target.argmax(-1).flatten(), p=2, weight=torch.linspace(0.5, 1.5, E,
                                                                                        device=out.device))),
        "multilabel_margin_loss": lambda: (*seq(nn.Identity()), lambda out, target: F.multilabel_margin_loss(
            out.flatten(0, 1), labels(target).flatten(0, 1))),
        "gaussian_nll_loss": lambda: (*seq(nn.Identity()), lambda out, target: F.gaussian_nll_loss(
            out[..., :E // 2], target[..., :E // 2], F.softplus(out[..., E // 2:]))),
        "cross_entropy_weighted": lambda: (*seq(nn.Identity()), lambda out, target: F.cross_entropy(
            out.transpose(1, 2), target.argmax(-1), weight=torch.linspace(0.5, 1.5, E, device=out.device))),
        # issue 49's lowerings: reductions and scans inside the model
        "median": lambda: fn(lambda h: h - h.median(-1, keepdim=True).values),
        "nanmedian": lambda: fn(lambda h: h - h.nanmedian(1, keepdim=True).values),
        "mode": lambda: fn(lambda h: h + h.mode(-1, keepdim=True).values),
        "cummin": lambda: fn(lambda h: h.cummin(1).values),
        "logcumsumexp": lambda: fn(lambda h: h.logcumsumexp(1)),
        "norm_p3": lambda: fn(lambda h: h / torch.norm(h, p=3, dim=-1, keepdim=True)),
        "renorm": lambda: fn(lambda h: torch.renorm(h, 2, 0, 1.0)),
        "linalg_cross": lambda: fn(cross, post=15),
        "cdist": lambda: seq(Pairwise(), post=T),
        "scatter_reduce_amax": lambda: fn(lambda h: bucket(h, "amax"), post=4),
        "index_reduce_mean": lambda: fn(lambda h: bucket(h, "mean"), post=4),
        "searchsorted": lambda: seq(Bucketed(search=True)),
        "bucketize": lambda: seq(Bucketed(search=False)),
        "rrelu_training": lambda: fn(lambda h: F.rrelu(h, training=True)),
        "embedding_bag_offsets_sum": lambda: (Between(nn.Identity(), Bags("sum"), nn.Linear(E, E)), "ids"),
        "embedding_bag_offsets_mean": lambda: (Between(nn.Identity(), Bags("mean"), nn.Linear(E, E)), "ids"),
        "embedding_bag_offsets_max": lambda: (Between(nn.Identity(), Bags("max"), nn.Linear(E, E)), "ids"),
        # issue 49's lowerings: pooling and resampling
        "avg_pool2d_ceil_no_pad": lambda: image(nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True,
                                                             count_include_pad=False)),
        "adaptive_max_pool3d": lambda: image(nn.AdaptiveMaxPool3d(3), 3),
        # (in - pool) / (out - 1) whole: each window's start is the same for every random sample torch draws
        "fractional_max_pool2d": lambda: image(nn.FractionalMaxPool2d(2, output_size=4)),
        "fractional_max_pool3d": lambda: image(nn.FractionalMaxPool3d(2, output_size=2), 3),
        "fractional_max_pool2d_random": lambda: image(nn.FractionalMaxPool2d(2, output_size=5)),  # 6/4: drawn
        "grid_sample_3d": lambda: image(Warp3d(), 3),
        "grid_sample_bicubic": lambda: image(nn.Identity(), call=lambda _, h: F.grid_sample(
            h, F.affine_grid(torch.tensor([[[0.9, 0.1, 0.05], [-0.1, 0.9, 0.0]]], device=h.device).expand(
                len(h), 2, 3), h.shape, align_corners=False), mode="bicubic", align_corners=False)),
    }


def labels(target):
    """multilabel_margin_loss's targets from a float target (B, T, E): each position's 3 largest features' classes,
    then -1 (the rest ignored)."""
    top = target.topk(3, -1).indices
    return torch.cat([top, torch.full_like(top, -1)[..., :1].expand(*top.shape[:-1], E - 3)], -1)


GROUPS = {  # a few families to a process: each process pays for torch_xla's start once
    "conv": ["conv1d", "conv2d", "conv2d_grouped", "conv3d", "conv_transpose1d", "conv_transpose2d",
             "conv_transpose3d", "batch_norm1d", "batch_norm2d", "batch_norm3d", "group_norm", "group_norm_1d",
             "instance_norm1d", "instance_norm2d", "instance_norm3d", "local_response_norm", "layer_norm_chw"],
    "pool": ["max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "lp_pool2d",
             "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
             "max_unpool2d", "upsample_nearest", "upsample_nearest_exact", "upsample_bilinear", "upsample_linear1d",
             "upsample_trilinear", "interpolate_bicubic", "grid_sample", "pixel_shuffle", "channel_shuffle",
             "pixel_unshuffle", "fold_unfold", "reflection_pad2d", "replication_pad2d"],
    "seq": ["layer_norm", "rms_norm", "embedding_bag_mean", "embedding_bag_max", "embedding", "rnn_cell", "lstm_cell",
            "gru_cell", "lstm", "gru_seq_first", "rnn_bidirectional", "sdpa_causal", "sdpa_bool_mask",
            "sdpa_float_mask", "kl_div", "kl_div_log_target", "cross_entropy_smoothed", "glu"],
    "losses_pooling": ["huber_loss", "multi_margin_loss", "multilabel_margin_loss", "gaussian_nll_loss",
                       "cross_entropy_weighted", "embedding_bag_offsets_sum", "embedding_bag_offsets_mean",
                       "embedding_bag_offsets_max", "avg_pool2d_ceil_no_pad", "adaptive_max_pool3d",
                       "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_random",
                       "grid_sample_3d", "grid_sample_bicubic"],
    "reductions": ["median", "nanmedian", "mode", "cummin", "logcumsumexp", "norm_p3", "renorm", "linalg_cross",
                   "cdist", "scatter_reduce_amax", "index_reduce_mean", "searchsorted", "bucketize", "rrelu_training"],
    "attention": ["unet", "multihead_attention", "multihead_attention_seq_first", "transformer_encoder_layer",
                  "transformer_decoder_layer", "transformer"],
}

RANDOM = {  # no eager comparison: numbers drawn at random, by eager on the CPU's generator, on XLA by each device's
    "rrelu_training": "F.rrelu in training draws each negative slope from uniform(lower, upper)",
    "fractional_max_pool2d_random": "its windows' starts are drawn (torch.rand, on the input's device)",
}
BAG_BYTES = B * E * 4  # one (bags, E) float tensor
GATHERS = {  # the float all-gather bytes a step may have under ddp: 1-D ids in bags from offsets. Which bag an id
    # lands in is data, so the bags (split over devices by the trainer's mark) need every device's ids' rows (a
    # reduce-scatter), and each device's ids need their bags' gradients: the bags' output gradient all-gathered, and
    # for "max" the output and the mask of the maxima too. Each B x E: without the mark, everything after ran whole.
    "embedding_bag_offsets_sum": BAG_BYTES, "embedding_bag_offsets_mean": BAG_BYTES,
    "embedding_bag_offsets_max": 3 * BAG_BYTES,
}


def build(name):
    """(model, batch, loss of (model, batch)): the same seeds in every process."""
    torch.manual_seed(0)
    built = cases()[name]()
    model, shape, loss = (*built, None) if len(built) == 2 else built
    g = torch.Generator().manual_seed(1)
    x = torch.randint(V, (B, 3), generator=g) if shape == "ids" else torch.randn(shape, generator=g)
    target = torch.randn(B, T, E, generator=g)
    if loss is None:
        return model, (x,), lambda m, b: m(b[0]).float().square().mean()
    return model, (x, target), lambda m, b: loss(m(b[0]), b[1])


def train(model, batch, loss_of, trainer=None):
    """STEPS plain SGD steps: (losses, the final weights and buffers by name)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if trainer is not None:
        batch = trainer.to_device(batch)
    losses = work_split.steps(model, batch, loss_of, optimizer, STEPS)
    state = {k: v.detach().float().cpu().flatten().tolist() for k, v in model.state_dict().items()
             if v.is_floating_point()}
    return [float(loss.cpu()) for loss in losses], state


def on_xla(names, dump, unfixed=False):
    """Each case with "ddp" and "fsdp" (or, `unfixed`, with "ddp" and the trainer's group_norm kernel overridden by
    torch_xla's own lowering: the trainer as it was before the fix, for the check to see what ran whole)."""
    import hlo
    import seamless_tpu as st
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("seamless_tpu").addHandler(handler)
    out, layouts = {}, {"ddp": {}} if unfixed else {"ddp": {}, "fsdp": {"strategy": "fsdp"}}
    for name in names:
        for layout, kwargs in layouts.items():
            before, logged[:] = hlo.dumped_files(dump), []
            print(f"{name}/{layout}", flush=True)
            model, batch, loss_of = build(name)
            trainer = st.SeamlessTPUTrainer(model, **kwargs)
            if unfixed:  # the trainer's kernels again, all but group_norm's
                ours = next(p.__self__ for p in st._STATE.torch_patches if isinstance(
                    getattr(p, "__self__", None), torch.library.Library))
                ours._destroy()
                st._STATE.torch_patches.append((unfixed_kernels := torch.library.Library("aten", "IMPL"))._destroy)
                for op, lowering in st._LOWERINGS.items():
                    if op != "group_norm" and not lowering.functional:
                        unfixed_kernels.impl(op, lowering.kernel, "AutogradXLA")
            cpu_ops = {k: met.counter_value(k) for k in met.counter_names() if k.startswith("aten::")}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses, state = train(model, batch, loss_of, trainer)
            on_cpu = sorted(k for k in met.counter_names()  # torch_xla's CPU fallbacks, counted since the case began
                            if k.startswith("aten::") and met.counter_value(k) > cpu_ops.get(k, 0))
            xm.wait_device_ops()  # torch_xla compiles on a thread of its own: its dump is written by then
            shapes = [tuple(p.shape) for p in model.parameters()]
            gathers = hlo.step_collectives(dump, shapes, skip=before)
            try:
                whole, per_device, share = hlo.dot_flops_per_device(dump, skip=before, count=hlo.matmul_flops)
            except AssertionError:  # no graph holds both matmul layers: an op fell back to the CPU in between
                whole = per_device = share = None
            activations = gathers.get(hlo.FLOAT_GATHER, (0, 0))[1] - gathers.get(hlo.PARAM_GATHER, (0, 0))[1]
            out[f"{name}/{layout}"] = {
                "losses": losses, "state": state, "share": share, "flops": [whole, per_device],
                "activation_gather_bytes": activations, "warnings": [str(w.message)[:300] for w in caught],
                "logged": list(logged), "compiles": trainer.compile_stats(), "on_cpu": on_cpu}
    return out


if __name__ == "__main__":
    if sys.argv[1] == "eager":
        child.report({name: train(*build(name)) for name in GROUPS[sys.argv[2]]})
    else:
        import hlo

        dump = tempfile.mkdtemp()
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {hlo.DUMP_FLAGS.format(dump)}".strip()
        unfixed = sys.argv[1] == "unfixed"
        child.report(on_xla(["unet"] if unfixed else GROUPS[sys.argv[1]], dump, unfixed))
