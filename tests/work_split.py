"""Every device does its own share of the work (issue 27): the models users write, trained 3 AdamW steps on 4
virtual XLA devices through SeamlessTPUTrainer with "ddp" and "fsdp", read from the partitioned HLO.

    python tests/work_split.py eager          # every model's eager losses (a process without XLA)
    python tests/work_split.py MODEL          # MODEL on XLA: losses, dot FLOPs per device, collectives, warnings
    python tests/work_split.py functionals    # the ops lowered on XLA against torch's own

Each reports one RESULT line (child.report).
"""

import functools
import logging
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import child

B, T, E, V = 16, 12, 64, 100
STEPS = 3


class Encoder(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, 4, 2 * E, dropout=0.0, batch_first=batch_first)
        self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(E, 1)
        self.seq_dim = 1 if batch_first else 0

    def forward(self, x):
        return self.head(self.enc(x).mean(self.seq_dim))


class WordLM(nn.Module):
    """pytorch/examples' word_language_model: (T, B) token batches through an LSTM."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.dec = nn.Embedding(V, E), nn.LSTM(E, E, 2), nn.Linear(E, V)

    def forward(self, x):
        out, _ = self.rnn(self.emb(x))
        return self.dec(out).view(-1, V)


class Block(nn.Module):  # nanoGPT's: pre-norm, causal SDPA
    def __init__(self):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(E), nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.ln2, self.fc, self.out = nn.LayerNorm(E), nn.Linear(E, 4 * E), nn.Linear(4 * E, E)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (z.view(b, t, 4, e // 4).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(E, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, e)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's shape. scan: the blocks run by torch_xla's scan_layers on XLA (torchprime's compile-time idiom: one
    traced block, looped; it deep-copies the first block, hooks and all), by a plain loop elsewhere."""

    def __init__(self, depth=2, scan=False, seq=T, vocab=V):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, E), nn.Parameter(torch.randn(seq, E) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.ln, self.head = nn.LayerNorm(E), nn.Linear(E, vocab, bias=False)
        self.scan, self.vocab = scan, vocab

    def forward(self, x):
        h = self.emb(x) + self.pos
        if self.scan and h.device.type == "xla":
            from torch_xla.experimental.scan_layers import scan_layers

            h = scan_layers(self.blocks, h)
        else:
            for block in self.blocks:
                h = block(h)
        return self.head(self.ln(h)).view(-1, self.vocab)


class Folded(nn.Module):
    """Defeats propagation: folds (B, T, E) into T*B rows, the batch minor, before its big Linear."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(E, 4 * E), nn.Linear(4 * E, 1)

    def forward(self, x):
        b, t, e = x.shape
        return self.head(self.proj(x.transpose(0, 1).reshape(t * b, e)).view(t, b, -1).mean(0))


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=E, intermediate_size=2 * E, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64))


def vit():
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=E, mlp_dim=2 * E,
                             num_classes=10)


def conv():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def conv_bn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def build(name):
    """(model, batch, loss of (model, batch)): the same seeds in every process."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(V, (B, T), generator=g)
    images = torch.randn(B, 3, 32, 32, generator=g)
    classes = torch.randint(10, (B,), generator=g)
    if name in ("encoder", "encoder_seq_first", "folded"):
        x = torch.randn(B, T, E, generator=g)
        x = x.transpose(0, 1).contiguous() if name == "encoder_seq_first" else x
        model = Folded() if name == "folded" else Encoder(batch_first=name == "encoder")
        return model, (x, torch.randn(B, 1, generator=g)), lambda m, b: F.mse_loss(m(b[0]), b[1])
    if name == "word_lm":
        x = torch.randint(V, (T, B), generator=g)
        return WordLM(), (x, torch.randint(V, (T * B,), generator=g)), lambda m, b: F.cross_entropy(m(b[0]), b[1])
    if name in ("gpt", "scan"):
        model = GPT() if name == "gpt" else GPT(depth=4, scan=True)
        return model, (tokens, tokens.roll(-1, 1).flatten()), lambda m, b: F.cross_entropy(m(b[0]), b[1])
    if name in ("vit", "conv", "conv_bn"):
        small = images[:, :, :16, :16].contiguous()
        model, x = {"vit": (vit, images), "conv": (conv, small), "conv_bn": (conv_bn, small)}[name]
        model = model()
        return model, (x, classes), lambda m, b: F.cross_entropy(m(b[0]), b[1])
    if name == "qwen3":
        mask = torch.ones(B, T, dtype=torch.long)
        mask[: B // 2, -3:] = 0  # padded rows
        batch = {"input_ids": tokens, "attention_mask": mask, "labels": tokens}
        return qwen3(), batch, lambda m, b: m(**b).loss
    raise KeyError(name)


MODELS = ["encoder", "encoder_seq_first", "gpt", "word_lm", "vit", "conv", "conv_bn", "qwen3"]


def steps(model, batch, loss_of, optimizer, n, after_step=None):
    """The plain loop, n steps: the losses, on the device; after_step() after each."""
    losses = []
    for _ in range(n):
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if after_step is not None:
            after_step()
    return losses


def train(model, batch, loss_of, trainer=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if trainer is not None:
        batch = trainer.to_device(batch)
    stats = []

    def counted():  # once the step ran: executions are counted as they end
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
        stats.append(trainer.compile_stats())

    losses = steps(model, batch, loss_of, optimizer, STEPS, counted if trainer is not None else None)
    return [float(loss.cpu()) for loss in losses], stats


def on_xla(name):
    import hlo
    import scenarios
    import seamless_tpu as st

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("seamless_tpu").addHandler(handler)
    dump, out = os.environ["SEAMLESS_TPU_HLO_DUMP"], {}
    layouts = {"ddp": {}, "fsdp": {"strategy": "fsdp"}}
    if name == "qwen3":
        layouts["tp"] = {"xla_spmd_config": {"model_parallel_size": 2}}
    for layout, kwargs in layouts.items():
        before = hlo.dumped_files(dump)
        model, batch, loss_of = build(name)
        trainer = st.SeamlessTPUTrainer(model, **kwargs)
        losses, stats = train(model, batch, loss_of, trainer)
        shapes = [tuple(p.shape) for p in model.parameters()]
        collectives, memory = hlo.step_collectives(dump, shapes), trainer.memory_stats()
        whole, per_device, share = hlo.dot_flops_per_device(dump, skip=before, count=hlo.matmul_flops)
        before_read, costs, read = trainer.compile_stats(), trainer.stats(), trainer.compile_stats()
        out[layout] = {"losses": losses, "dots": share, "hlo_dot_flops": [whole, per_device], "costs": costs,
                       "stats_read": [read, before_read],
                       "describe_wrong": scenarios.describe_mismatches(trainer, model),
                       "tokens_6nt": 6 * sum(p.numel() for p in model.parameters()) * B * T,
                       "all_gather_bytes": collectives.get("all-gather", (0, 0))[1],
                       "all_reduce_bytes": collectives.get("all-reduce", (0, 0))[1],
                       "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
                       "device_share": max(memory["per_device"]) / memory["replica"],
                       "batch_dim": trainer.layout.batch.dim, "stats": stats}
    out["warnings"] = warnings
    return out


def functionals():
    """The ops the trainer lowers on XLA against torch's own (the same call on CPU tensors), over
    the options that reach them: per case, the largest difference of the outputs and of every input's gradient,
    relative to the largest value."""
    import seamless_tpu as st

    st.SeamlessTPUTrainer(nn.Linear(2, 2))  # the replacements are in place from the first XLA trainer
    device, g = st.get_device(), torch.Generator().manual_seed(0)
    e, heads, t, s, b = 16, 4, 5, 7, 8

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def diff(fn, tensors, masks=(), autocast=False):
        results = []
        for where in ("cpu", device):
            inputs = [x.to(where).requires_grad_() for x in tensors]
            with torch.autocast(torch.device(where).type, dtype=torch.bfloat16, enabled=autocast):
                outs = fn(*inputs, *(m if m is None else m.to(where) for m in masks))
                outs = [o for o in (outs if isinstance(outs, tuple) else [outs]) if o is not None]
            loss = sum((o.float() * torch.arange(o.numel(), device=where).view(o.shape).cos()).sum() for o in outs)
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # a weight the options leave out
            results.append([x.detach().float().cpu() if x is not None else None for x in (*outs, *grads)])
        if [x is None for x in results[0]] != [x is None for x in results[1]]:
            return math.inf  # they use different inputs
        return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(*results) if x is not None)

    def mha(need_weights=False, average=True, separate=False, bias=True):
        def run(q, k, v, w_in, b_in, w_out, b_out, wq, wk, wv, mask=None, key_padding_mask=None):
            return F.multi_head_attention_forward(
                q, k, v, e, heads, w_in, b_in if bias else None, None, None, False, 0.0, w_out,
                b_out if bias else None, training=True, key_padding_mask=key_padding_mask, need_weights=need_weights,
                attn_mask=mask, use_separate_proj_weight=separate, q_proj_weight=wq, k_proj_weight=wk,
                v_proj_weight=wv, average_attn_weights=average)
        return run

    def qkv(kdim=e):  # (T, B, E) query, (S, B, kdim) key and value, then the weights
        w = e ** -0.5  # weights as nn.MultiheadAttention's init scales them
        return [randn(t, b, e), randn(s, b, kdim), randn(s, b, kdim), randn(3 * e, e) * w, randn(3 * e) * w,
                randn(e, e) * w, randn(e) * w, randn(e, e) * w, randn(e, kdim) * w, randn(e, kdim) * w]

    def batch_norm(x, w=None, c=None, stats=True):  # the output, and the running statistics it updated
        mean, var = (torch.zeros(x.shape[1], device=x.device), torch.ones(x.shape[1], device=x.device)) if stats \
            else (None, None)
        return F.batch_norm(x, mean, var, w, c, True, 0.1, 1e-5), mean, var

    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[::2, -2:] = True
    causal, no_mask = torch.ones(t, s, dtype=torch.bool).triu(1), None
    cases = {  # name: (fn, differentiable inputs, masks, autocast)
        "linear 3-D": (F.linear, [randn(4, b, e), randn(3, e), randn(3)], (), False),
        "linear 4-D no bias": (F.linear, [randn(2, 3, b, e), randn(5, e)], (), False),
        "linear 3-D bf16 autocast": (F.linear, [randn(4, b, e), randn(3, e), randn(3)], (), True),
        "linear 3-D by a vector weight": (F.linear, [randn(4, b, e), randn(e)], (), False),
        "matmul 4-D @ 4-D (attention's scores)": (torch.matmul, [randn(b, heads, t, 4), randn(b, heads, 4, s)], (),
                                                  False),
        "matmul 3-D @ 2-D, bf16 autocast": (torch.matmul, [randn(t, b, e), randn(e, 3)], (), True),
        "matmul broadcast (B, H, T, d) @ (H, d, S)": (torch.matmul, [randn(b, heads, t, 4), randn(heads, 4, s)], (),
                                                     False),
        "layer_norm affine": (lambda x, w, c: F.layer_norm(x, (e,), w, c), [randn(b, t, e) * 3 + 1, randn(e),
                                                                         randn(e)], (), False),
        "layer_norm 2 dims, no affine": (lambda x: F.layer_norm(x, (t, e)), [randn(b, t, e)], (), False),
        "layer_norm bf16 input": (lambda x, w, c: F.layer_norm(x.bfloat16(), (e,), w, c), [randn(b, t, e),
                                                                                       randn(e), randn(e)], (), False),
        "mha no mask": (mha(), qkv(), (), False),
        "mha key padding": (mha(), qkv(), (no_mask, pad), False),
        "mha float mask + key padding": (mha(), qkv(), (randn(t, s), pad), False),
        "mha bool causal mask": (mha(), qkv(), (causal,), False),
        "mha per-head 3-D mask": (mha(), qkv(), (randn(b * heads, t, s),), False),
        "mha need_weights averaged": (mha(need_weights=True), qkv(), (no_mask, pad), False),
        "mha need_weights per head": (mha(need_weights=True, average=False), qkv(), (causal,), False),
        "mha separate kdim weights, no bias": (mha(separate=True, bias=False), qkv(kdim=6), (), False),
        "mha bf16 autocast": (mha(), qkv(), (no_mask, pad), True),
        "batch_norm training 4-D": (batch_norm, [randn(b, 3, 4, 4) * 2 + 1, randn(3), randn(3)], (), False),
        "batch_norm no running stats": (lambda x: batch_norm(x, stats=False), [randn(b, 5)], (), False),
        "batch_norm bf16 autocast": (batch_norm, [randn(b, 3, 4, 4), randn(3), randn(3)], (), True),
        # the kernels tests/op_sweep.py's families brought (dispatcher-level, so torch.* and F reach them alike)
        "group_norm affine": (lambda x, w, c: F.group_norm(x, 4, w, c), [randn(b, 8, 5, 5), randn(8), randn(8)], (),
                              False),
        "instance_norm": (F.instance_norm, [randn(b, 3, 6, 6) * 2 + 1], (), False),
        "conv2d groups 4 stride 2": (lambda x, w: F.conv2d(x, w, None, 2, 1, 1, 4), [randn(b, 8, 9, 9),
                                                                                   randn(8, 2, 3, 3)], (), False),
        "conv1d depthwise dilation 2": (lambda x, w, c: F.conv1d(x, w, c, 1, 2, 2, 6), [randn(b, 6, 10),
                                                                                      randn(6, 1, 3), randn(6)], (),
                                        False),
        "unfold then fold": (lambda x: F.fold(F.unfold(x, 3, padding=1, stride=2), (9, 9), 3, padding=1, stride=2),
                             [randn(b, 3, 9, 9)], (), False),
        "adaptive avg pool 9 -> (4, 2)": (lambda x: F.adaptive_avg_pool2d(x, (4, 2)), [randn(b, 3, 9, 9)], (), False),
        "adaptive max pool 9 -> (4, 5)": (lambda x: F.adaptive_max_pool2d(x, (4, 5)), [randn(b, 3, 9, 9)], (), False),
        "kl_div batchmean": (lambda a, t: F.kl_div(a.log_softmax(-1), t.softmax(-1), reduction="batchmean"),
                             [randn(b, 10), randn(b, 10)], (), False),
        "kl_div log_target": (lambda a, t: F.kl_div(a.log_softmax(-1), t.log_softmax(-1), log_target=True),
                              [randn(b, 10), randn(b, 10)], (), False),
        "embedding_bag mean, padding": (lambda w, ids: F.embedding_bag(ids, w, mode="mean", padding_idx=3),
                                        [randn(10, 4)], (torch.randint(10, (b, 5), generator=g),), False),
        "embedding_bag max": (lambda w, ids: F.embedding_bag(ids, w, mode="max"), [randn(10, 4)],
                              (torch.randint(10, (b, 5), generator=g),), False),
        **{f"interpolate {mode} {size}": (lambda x, mode=mode, size=size: F.interpolate(
            x, **({"size": (5, 13)} if size == "to size" else {"scale_factor": 2}), mode=mode,
            **({} if mode.startswith("nearest") else {"align_corners": False})), [randn(b, 3, 7, 7)], (), False)
           for mode in ("nearest", "nearest-exact", "bilinear", "bicubic") for size in ("x2", "to size")},
        "interpolate nearest-exact 1-D x0.4": (lambda x: F.interpolate(x, scale_factor=0.4, mode="nearest-exact"),
                                               [randn(b, 3, 12)], (), False),
        "interpolate nearest-exact 3-D to size": (lambda x: F.interpolate(x, size=(3, 7, 4), mode="nearest-exact"),
                                                  [randn(2, 3, 5, 5, 5)], (), False),
        "interpolate trilinear": (lambda x: F.interpolate(x, size=(3, 7, 4), mode="trilinear"),
                                  [randn(2, 3, 5, 5, 5)], (), False),
        "glu dim 1": (lambda x: F.glu(x, 1), [randn(b, 6, 5)], (), False),
        **{f"grid_sample {mode} {pad} align_corners={corners}": (
            lambda x, grid, mode=mode, pad=pad, corners=corners: F.grid_sample(
                x, grid, mode, pad, corners), [randn(b, 3, 6, 7), torch.rand(b, 5, 4, 2, generator=g) * 2.4 - 1.2],
            (), False) for mode, pad, corners in (("bilinear", "zeros", False), ("bilinear", "border", True),
                                                   ("nearest", "zeros", True), ("nearest", "border", False),
                                                   ("bilinear", "reflection", False), ("bicubic", "reflection", True))},
        "grid_sample 3-D bilinear border": (lambda x, grid: F.grid_sample(x, grid, "bilinear", "border"), [
            randn(b, 3, 4, 5, 6), torch.rand(b, 3, 4, 2, 3, generator=g) * 2.4 - 1.2], (), False),
        "channel_shuffle 3 groups": (lambda x: F.channel_shuffle(x, 3), [randn(b, 6, 4, 4)], (), False),
    }
    out = {name: diff(*case) for name, case in cases.items()}
    refusals = []  # a size torch refuses: the same error on XLA
    for where in ("cpu", device):
        for bad in (lambda: F.glu(torch.ones(2, 5, device=where)), lambda: F.channel_shuffle(
                torch.ones(2, 5, 3, device=where), 2)):
            try:
                bad()
            except RuntimeError as e:
                refusals.append(str(e))
    out["glu and channel_shuffle refuse as torch"] = 0.0 if refusals[:2] == refusals[2:] and len(refusals) == 4 \
        else math.inf
    # Sizes linear and matmul refuse: torch_xla's own errors (its words are not the CPU's), not those of the einsum
    # the kernels build on (a matmul of mismatched sizes read "einsum(): subscript n has size 3 ...")
    ones = functools.partial(torch.ones, device=device)
    named = []
    for bad in (lambda: F.linear(ones(2, 3, 4), ones(5, 3)), lambda: F.linear(ones(2, 3, 4), ones(5, 4), ones(6)),
                lambda: ones(2, 3, 4) @ ones(5, 3), lambda: ones(2, 3, 4) @ ones(2, 5, 3)):
        try:
            bad()
        except RuntimeError as e:
            named.append("einsum" not in str(e))
    out["linear and matmul refuse as torch_xla"] = 0.0 if named == [True] * 4 else math.inf
    return out


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "functionals":
        child.report(functionals())
    elif which == "eager":
        child.report({name: train(*build(name))[0] for name in MODELS + ["folded", "scan"]})
    else:
        import hlo

        os.environ["SEAMLESS_TPU_HLO_DUMP"] = dump = tempfile.mkdtemp()
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {hlo.DUMP_FLAGS.format(dump)}".strip()
        child.report(on_xla(which))
