"""Fast tier of issue 48: which stacks of blocks may run as one loop, decided without torch_xla (room 9c's pure
rules). Their real twins: tests/block_loops.py (the loops on real torch_xla, and the fallbacks' logged reasons)."""

import pytest
import torch

import block_loops
import seamless_tpu as st

pytestmark = pytest.mark.fast


class Checked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(block_loops.Block(8) for _ in range(3))


def owner(forward):
    """A Checked whose class has `forward`."""
    return type("Owner", (Checked,), {"forward": forward})()


def ok_enumerate(self, x, mask=None):
    for i, layer in enumerate(self.layers[:2]):
        x = layer(x, mask=mask, kind=layer.kind, at=i)
    return x


def ok_plain(self, x):
    h = x * 2
    for layer in self.layers:
        h = layer(h)
    return h


def reads_carry_twice(self, x):
    for layer in self.layers:
        x = layer(x, x)
    return x


def passes_the_block(self, x):
    for layer in self.layers:
        x = layer(x, layer)
    return x


def two_statements(self, x):
    for layer in self.layers:
        x = layer(x)
        x = torch.relu(x)
    return x


def other_target(self, x):
    for layer in self.layers:
        y = layer(x)
    return y


def breaks(self, x):
    for layer in self.layers:
        x = layer(x)
    else:
        x = x + 1
    return x


def twice(self, x):
    for layer in self.layers:
        x = layer(x)
    for layer in self.layers:
        x = layer(x)
    return x


def never(self, x):
    return self.layers[0](x)


def ok_renamed(this, x):  # `self` by another name
    for layer in this.layers:
        x = layer(x)
    return x


def ok_passes_on(self, x, mask=None):  # T5's: the block returns its position bias, which the next one takes
    bias = None
    for layer in self.layers:
        x, own, _ = layer(x, mask, bias)
        bias = own
    return x


def ok_passes_on_if(self, x, enc=None):
    cross = None
    for layer in self.layers:
        x, _, out = layer(x, cross_bias=cross)
        if enc is not None:
            cross = out
    return x


def reads_an_output_after(self, x):
    for layer in self.layers:
        x, extra = layer(x)
    return x + extra


def passes_on_what_it_never_gives(self, x):
    for layer in self.layers:
        x, own = layer(x)
        bias = own  # noqa: F841 (read by nothing: not passed to the next call)
    return x


@pytest.mark.parametrize("forward, outputs, feeds", [
    (ok_enumerate, 0, {}), (ok_plain, 0, {}), (ok_renamed, 0, {}), (ok_passes_on, 3, {1: ("arg", 1)}),
    (ok_passes_on_if, 3, {2: ("kw", "cross_bias")})])
def test_a_loop_that_only_carries_its_value_through_the_blocks_may_run_as_one(forward, outputs, feeds):
    """Issue 61's forms: enumerate of a slice with keyword arguments (Qwen3's), `self` by any name, and T5's, where a
    block returns values the owner passes on to the next block (always, or under an `if`)."""
    form, why = st._loop_code(owner(forward), "layers")
    assert form.code is forward.__code__ and why is None
    assert (form.outputs, form.feeds) == (outputs, feeds)


@pytest.mark.parametrize("forward, why", [
    (reads_carry_twice, "does more than `x = block(x, ...)`"), (passes_the_block, "does more than"),
    (two_statements, "does more than"), (other_target, "does more than"), (breaks, "does more than"),
    (twice, "iterates it 2 times, not once"), (never, "does not iterate it"),
    (reads_an_output_after, "does more than"), (passes_on_what_it_never_gives, "does more than"),
])
def test_a_loop_that_does_more_stays_unrolled_and_says_why(forward, why):
    code, said = st._loop_code(owner(forward), "layers")
    assert code is None and why in said and "Owner.forward" in said, said


def test_the_loops_of_transformers_and_torch_are_checked_from_their_source(no_xla):
    """Qwen3 and Llama iterate a slice with enumerate and keyword arguments; GPT-2 and BERT positional ones;
    nn.TransformerEncoder its layers; nn.Sequential itself (its own forward)."""
    transformers = pytest.importorskip("transformers")
    for arch in ("qwen3", "llama", "gpt2", "bert", "gemma2", "modernbert", "vit", "t5"):
        model = block_loops.hf(arch)
        stack = next((path, m) for path, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
        parent = model.get_submodule(stack[0].rpartition(".")[0])
        code, why = st._loop_code(parent, stack[0].rpartition(".")[2])
        assert code is not None and why is None, (arch, why)
    assert isinstance(block_loops.hf("gpt2"), transformers.PreTrainedModel)
    encoder = block_loops.encoder()[1]
    assert st._loop_code(encoder, "layers")[0].code is torch.nn.TransformerEncoder.forward.__code__
    assert st._loop_code(torch.nn.Sequential(), None)[0].code is torch.nn.Sequential.forward.__code__


def test_a_forward_without_source_stays_unrolled_and_says_why():
    namespace = {}
    exec("def forward(self, x):\n    for layer in self.layers:\n        x = layer(x)\n    return x", namespace)
    code, why = st._loop_code(owner(namespace["forward"]), "layers")
    assert code is None and why == "the source of Owner.forward is not available to check its loop"


def layers(**changes):
    blocks = [block_loops.Block(8) for _ in range(3)]
    for k, change in changes.items():
        change(blocks[int(k[1:])])
    return blocks


def index(name):
    return {f"b{k}": (lambda k: lambda b: setattr(b, name, k))(k) for k in range(3)}


@pytest.mark.parametrize("changes, plan", [
    ({}, (0, 3, 1)),
    ({"b1": lambda b: setattr(b, "layer_idx", 1)}, "block 1 differs from block 0 in layer_idx (1 against None)"),
    (index("layer_idx"), (0, 3, 1)),  # an index may differ: the body's trace proves it unread, or says why
    ({f"b{k}": (lambda k: lambda b: setattr(b, "name", f"layers.{k}.up"))(k) for k in range(3)}, (0, 3, 1)),
    ({"b2": lambda b: setattr(b.drop, "p", 0.5)}, (0, 2, 1)),  # the last block on its own
    ({"b0": lambda b: setattr(b.drop, "p", 0.5)}, (1, 3, 1)),  # the first
    ({"b1": lambda b: setattr(b, "up", torch.nn.Linear(8, 16, bias=False))}, "parameters or buffers of module 'up'"),
    ({"b1": lambda b: b.add_module("extra", torch.nn.Identity())}, "block 1 differs from block 0 in its modules"),
    ({"b1": lambda b: b.up.weight.requires_grad_(False)}, (0, 3, 1)),  # the loop gives frozen blocks no gradient
    ({"b0": lambda b: b.register_buffer("seen", torch.zeros(1)), "b1": lambda b: b.register_buffer(
        "seen", torch.zeros(1)), "b2": lambda b: b.register_buffer("seen", torch.zeros(1))}, "hold buffers"),
    ({"b0": lambda b: setattr(b, "scale", torch.ones(2)), "b1": lambda b: setattr(b, "scale", torch.ones(2)),
      "b2": lambda b: setattr(b, "scale", torch.ones(2) * 3)}, "holds the tensor 'scale', neither parameter nor "),
])
def test_the_longest_run_of_repeating_blocks_is_planned_as_one_loop(changes, plan):
    got, why = st._plan([st._block_state(b) for b in layers(**changes)])
    assert tuple(got) == plan if isinstance(plan, tuple) else got is None and plan in why, (got, why)


def test_blocks_that_repeat_with_a_period_loop_a_period_a_turn():
    """Gemma2's sliding and global layers alternate (period 2), Gemma3's are five to one (period 6); T5's first block
    differs (a prefix); an attribute that differs in every block (an index) does not stop a plan, one that repeats
    with the period does not either, and the run must turn twice."""
    def blocks(kinds):
        out = [block_loops.Block(8) for _ in kinds]
        for k, (b, kind) in enumerate(zip(out, kinds)):
            b.kind, b.layer_idx = kind, k
        return out
    plan = lambda kinds: st._plan([st._block_state(b) for b in blocks(kinds)])[0]  # noqa: E731
    assert plan("sgsgsg") == (0, 6, 2)
    assert plan("sssssgsssssgss") == (0, 12, 6)  # two blocks after: on their own
    assert plan("xaaaa") == (1, 5, 1)
    assert plan("sgsx") is None and "no run of blocks repeats" in st._plan(
        [st._block_state(b) for b in blocks("sgsx")])[1]
    assert plan("abcabc") == (0, 6, 3)


def test_scan_takes_a_bool(cpu):
    with pytest.raises(TypeError, match=r"scan must be True \(repeated blocks run as one loop on XLA\) or False, got "
                                        r"'yes'"):
        st.SeamlessTPUTrainer(torch.nn.Linear(2, 2), scan="yes")


LOOPED_HLO = """HloModule looped

%cond (p: (s64[], f32[4,8])) -> pred[] {
  %p = (s64[], f32[4,8]) parameter(0)
  %i = s64[] get-tuple-element(%p), index=0
  %n = s64[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s64[], f32[4,8])) -> (s64[], f32[4,8]) {
  %p = (s64[], f32[4,8]) parameter(0)
  %i = s64[] get-tuple-element(%p), index=0
  %x = f32[4,8] get-tuple-element(%p), index=1
  %w = f32[8,8] constant({...})
  %y = f32[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s64[], f32[4,8]) tuple(%i, %y)
}

ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8] parameter(0)
  %b = f32[8,2] parameter(1)
  %zero = s64[] constant(0)
  %init = (s64[], f32[4,8]) tuple(%zero, %a)
  %loop = (s64[], f32[4,8]) while(%init), condition=%cond, body=%body
  %h = f32[4,8] get-tuple-element(%loop), index=1
  ROOT %out = f32[4,2] dot(%h, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_the_hlo_reader_counts_a_loops_body_as_often_as_it_runs():
    """bench/hlo.py's dot FLOPs of a program with a While: the body's dot 6 times (its condition's trip count), the
    entry's once; the tiers' work split and FLOP checks read looped programs through it."""
    import hlo

    body_dot, head_dot = 2 * 4 * 8 * 8, 2 * 4 * 2 * 8
    assert hlo.dot_flops(LOOPED_HLO) == 6 * body_dot + head_dot
    assert sorted(n for _, n in hlo.runs(LOOPED_HLO)) == [1, 6]  # the entry once, the body 6 times


def test_the_hlo_reader_counts_a_loops_collectives_as_often_as_they_run(tmp_path):
    """bench/hlo.py's step collectives, read from a dump of one partitioned program whose loop body all-gathers an
    (8, 8) weight: 6 gathers of 256 bytes, a parameter's shape (counted once per body, the work tier's fsdp gather
    bound could not fail on a looped model)."""
    import hlo

    gathered = LOOPED_HLO.replace("%w = f32[8,8] constant({...})", "%s = f32[2,8] constant({...})\n"
                                  "  %w = f32[8,8] all-gather(%s), replica_groups={}, dimensions={0}")
    module = tmp_path / "module_0001.SyncTensorsGraph.1"
    for suffix, text in ((".0001.spmd-partitioner.before_spmd-partitioning.txt", LOOPED_HLO),
                         (".0002.spmd-partitioner.after_spmd-partitioning.txt", LOOPED_HLO),
                         (".cpu_after_optimizations.txt", gathered)):
        (tmp_path / (module.name + suffix)).write_text(text)
    assert hlo.step_collectives(str(tmp_path), [(8, 8)]) == {
        "all-gather": (6, 6 * 256), hlo.PARAM_GATHER: (6, 6 * 256), hlo.FLOAT_GATHER: (6, 6 * 256)}


@pytest.mark.parametrize("remat", [False, True])
def test_a_loop_body_saves_its_parameters_not_their_views_for_the_backward(remat, monkeypatch):
    """A linear reads `W.t()`: AOT's partitioner would save that view, which scan writes into a buffer per block (a
    copy of the stacked parameters); ours saves W itself, which scan passes through. Under checkpointing (budget 0)
    the body saves only its inputs. `x @ W.t()` becomes one dot over W as stored (XLA's, here torch's stand-in). The
    partition notes which inputs the backward gives a gradient."""
    dots = []
    monkeypatch.setattr(st, "_dot_transposed", lambda a, w: dots.append(w.shape) or a @ w.t())
    from functorch.compile import aot_function, default_partition, make_boxed_func, min_cut_rematerialization_partition

    graphs = []

    def keep(module, _):
        graphs.append(module)
        return make_boxed_func(module)
    partition = st._saving_primals(min_cut_rematerialization_partition if remat else default_partition, 1, remat)
    body = aot_function(lambda x, w: torch.tanh(x @ w.t()) @ w, fw_compiler=keep, bw_compiler=keep,
                        partition_fn=partition)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    body(x, w).sum().backward()
    want = torch.autograd.grad((torch.tanh(x @ w.t()) @ w).sum(), (x, w))
    torch.testing.assert_close((x.grad, w.grad), want)
    forward = graphs[0].graph
    saved = next(iter(forward.find_nodes(op="output"))).args[0][1:]
    assert all(n.op == "placeholder" or "tanh" in n.name for n in saved), [n.name for n in saved]
    assert any(n.name == "primals_2" for n in saved), [n.name for n in saved]
    assert remat == (not any("tanh" in n.name for n in saved)), [n.name for n in saved]
    assert not [n for g in graphs for n in g.graph.nodes if n.target is torch.ops.aten.mm.default
                and n.args[1].target is torch.ops.aten.t.default]
    assert dots[0] == (8, 8), dots  # the forward's x @ w.t(): w as stored
    given = []
    unused = aot_function(lambda x, w, u: torch.tanh(x @ w.t()) @ w, fw_compiler=keep, bw_compiler=keep,
                          partition_fn=st._saving_primals(default_partition, 1, False, given))
    unused(x, w, torch.randn(8, requires_grad=True)).sum().backward()
    assert given == [True, True, False], "a parameter the body does not use gets no gradient (None, as in eager)"
