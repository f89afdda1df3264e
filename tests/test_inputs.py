"""Fast tier: what users hand the module. to_device must never change what a batch means, and
prepare_data_loader must honour the user's sampler and dataset. (xla_spmd_config's validation is with the
other mesh rules, in test_seamless_tpu.py.)

Cases follow accelerate's send_to_device tests and Lightning's apply_to_collection tests; values are
checked on the CPU, and moves are shown by sending to 'meta', where every tensor really moves on any
machine. One case per container type; the fixtures are in conftest.py.
"""

import collections
import dataclasses
import functools
import types

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils.data import (
    BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, SubsetRandomSampler, WeightedRandomSampler,
)

import scenarios
import seamless_tpu as st

pytestmark = pytest.mark.fast

META = torch.device("meta")
CPU = torch.device("cpu")


def moved(obj):
    return isinstance(obj, torch.Tensor) and obj.device.type == "meta"


# --- helper types ----------------------------------------------------------------------------------

Point = collections.namedtuple("Point", "x y")


class MyTensor(torch.Tensor):
    pass


@dataclasses.dataclass
class Plain:
    x: torch.Tensor
    label: str = "cat"
    extra: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    label: str = "cat"
    extra: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class Slotted:
    x: torch.Tensor
    label: str = "cat"
    extra: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Shifted:
    ids: torch.Tensor

    def __post_init__(self):
        self.ids = self.ids + 1


@dataclasses.dataclass(frozen=True)
class FrozenShifted:
    ids: torch.Tensor

    def __post_init__(self):
        object.__setattr__(self, "ids", self.ids + 1)


@dataclasses.dataclass
class Tagged:
    x: torch.Tensor
    tag: str = dataclasses.field(init=False, default="new")
    mask: torch.Tensor = dataclasses.field(init=False, default=None)


@dataclasses.dataclass
class Scaled:
    x: torch.Tensor
    scale: dataclasses.InitVar[float]

    def __post_init__(self, scale):
        self.x = self.x * scale


@dataclasses.dataclass
class MovesItself:
    x: torch.Tensor
    moved_by_to: bool = False

    def to(self, *args, **kwargs):
        return MovesItself(self.x.to(*args, **kwargs), moved_by_to=True)


class MovesInPlace:
    def __init__(self):
        self.x = torch.ones(2)

    def to(self, *args, **kwargs):  # returns None: the object itself is the result
        self.x = self.x.to(*args, **kwargs)


class Pair(list):
    def __init__(self, first, second):
        super().__init__([first, second])


class Span(tuple):
    def __new__(cls, start, end):
        return super().__new__(cls, (start, end))


class Tokens(list):
    pass


class Registry(collections.abc.Mapping):
    def __init__(self, name, pairs):
        self.name, self._items = name, dict(pairs)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


# --- to_device: tensors, and how they move -------------------------------------------------------


def test_to_device_tensor():
    assert moved(st.to_device(torch.ones(2), device=META))


def test_to_device_several_return_a_tuple():
    a, b = st.to_device(torch.ones(2), torch.zeros(3), device=META)
    assert moved(a) and moved(b)


class RecordsTo:
    def __init__(self):
        self.calls = []

    def to(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self


def test_non_blocking_only_for_cuda():
    cuda, cpu = RecordsTo(), RecordsTo()
    st._mover(torch.device("cuda", 0))(cuda)
    st._mover(torch.device("cpu"))(cpu)
    assert cuda.calls == [{"non_blocking": True}] and cpu.calls == [{"non_blocking": False}]


# --- to_device: tensor subclasses ------------------------------------------------------------------


def batch_4x2(kind):
    t = torch.arange(8.0).reshape(4, 2)
    return {"tensor": t, "parameter": torch.nn.Parameter(t), "subclass": t.as_subclass(MyTensor)}[kind]


@pytest.mark.parametrize("kind", ["tensor", "parameter", "subclass"])
def test_tensor_subclass_keeps_type_shape_and_values_on_cpu(no_xla, kind):
    x = batch_4x2(kind)
    out = st.to_device(x, device="cpu")
    assert type(out) is type(x) and out.shape == (4, 2) and torch.equal(out, x)


@pytest.mark.parametrize("kind", ["tensor", "parameter", "subclass"])
def test_tensor_subclass_keeps_shape_and_values_on_xla(fake, kind):
    x = batch_4x2(kind)
    out = st.to_device(x)
    assert isinstance(out, torch.Tensor) and out.shape == (4, 2) and torch.equal(out.detach(), x.detach())
    # The fake's XLA device is the CPU, so the values cannot show the move; the transfer can: the
    # batch went to XLA split over the 4 devices (a tensor left alone has no sharding).
    assert fake.shardings.get(out) == scenarios.SPEC_2D, f"not moved to XLA and sharded: {fake.events}"


# --- to_device: dataclasses are copied, never rebuilt ---------------------------------------------


@pytest.mark.parametrize("cls", [Plain, Frozen, Slotted])
def test_dataclass_moves_on_a_copy(cls):
    obj = cls(torch.ones(2), extra=[torch.ones(1)])
    out = st.to_device(obj, device=META)
    assert type(out) is cls and out is not obj and moved(out.x) and out.label == "cat" and moved(out.extra[0])
    assert obj.x.device == CPU and obj.extra[0].device == CPU, "the original must not be mutated"


@pytest.mark.parametrize("cls", [Shifted, FrozenShifted])
def test_dataclass_post_init_is_not_run_again(no_xla, cls):
    obj = cls(torch.tensor([1, 2]))
    out = st.to_device(obj, device="cpu")
    assert type(out) is cls and out.ids.tolist() == [2, 3]
    assert obj.ids.tolist() == [2, 3]


def test_dataclass_keeps_init_false_fields(no_xla):
    obj = Tagged(torch.ones(2))
    obj.tag, obj.mask = "seen", torch.zeros(3)
    out = st.to_device(obj, device="cpu")
    assert out.tag == "seen" and torch.equal(out.mask, torch.zeros(3)) and torch.equal(out.x, torch.ones(2))


def test_dataclass_with_initvar(no_xla):
    obj = Scaled(torch.ones(2), 3.0)
    out = st.to_device(obj, device="cpu")
    assert type(out) is Scaled and out.x.tolist() == [3.0, 3.0]


class cached_on_instance:
    """A hand-rolled caching descriptor, like many libraries write: it stores the value in the
    instance dict under its own name on first access."""

    def __init__(self, fn):
        self.fn, self.name = fn, fn.__name__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclasses.dataclass
class Cached:
    x: torch.Tensor

    @functools.cached_property
    def total(self):
        return self.x.sum()

    @cached_on_instance
    def doubled(self):
        return self.x * 2

    def describe(self):
        return "class method"


@dataclasses.dataclass(frozen=True)
class FrozenCached:
    x: torch.Tensor

    @functools.cached_property
    def total(self):
        return self.x.sum()


@pytest.mark.parametrize("cls", [Cached, FrozenCached])
def test_dataclass_cached_property_follows_the_moved_fields(cls):
    """A value cached on the original (from its old fields, on the old device) is recomputed from the
    moved fields, as Lightning's apply_to_collection does; the original keeps its own."""
    obj = cls(torch.ones(2))
    assert obj.total.device == CPU and "total" in vars(obj)
    out = st.to_device(obj, device=META)
    assert "total" not in vars(out), "the copy must not inherit the value cached from the old fields"
    assert moved(out.x) and moved(out.total)
    assert obj.total.device == CPU and obj.total.item() == 2.0


def test_dataclass_any_caching_descriptor_is_recomputed():
    obj = Cached(torch.ones(2))
    obj.doubled  # noqa: B018  (fills the instance dict)
    out = st.to_device(obj, device=META)
    assert "doubled" not in vars(out) and moved(out.doubled)


def test_dataclass_values_cached_from_changed_fields_are_recomputed():
    """Not only the device: a mapping that changes values must not leave a stale cached value."""
    obj = Cached(torch.ones(2))
    assert obj.total.item() == 2.0
    out = st._map_tensors(obj, lambda t: t + 1)
    assert out.x.tolist() == [2.0, 2.0] and out.total.item() == 4.0 and obj.total.item() == 2.0


def test_dataclass_instance_attributes_that_are_not_caches_are_kept():
    """Only what a caching descriptor wrote is dropped: a method the user replaced on the instance,
    or a plain extra attribute, is the user's data and stays."""
    obj = Cached(torch.ones(2))
    obj.describe = lambda: "instance override"
    obj.note = "kept"
    out = st.to_device(obj, device=META)
    assert out.describe() == "instance override" and out.note == "kept"


# --- to_device: objects with their own .to -------------------------------------------------------


def packed():
    padded = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    return pack_padded_sequence(padded, torch.tensor([2, 3]), batch_first=True, enforce_sorted=False)


def test_packed_sequence_round_trips(no_xla):
    seq = packed()
    out = st.to_device(seq, device="cpu")
    assert type(out) is PackedSequence
    for name in ("data", "batch_sizes", "sorted_indices", "unsorted_indices"):
        assert torch.equal(getattr(out, name), getattr(seq, name)), name
    padded, lengths = pad_packed_sequence(out, batch_first=True)
    assert padded.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]] and lengths.tolist() == [2, 3]


def test_packed_sequence_is_moved_by_its_own_to():
    seq = packed()
    out = st.to_device(seq, device=META)
    # PackedSequence.to keeps batch_sizes on the CPU (pack/unpack need it there); a field-wise
    # rebuild would move it.
    assert type(out) is PackedSequence and moved(out.data)
    assert out.batch_sizes.device == CPU and torch.equal(out.batch_sizes, seq.batch_sizes)


def test_module_is_moved_by_its_own_to():
    out = st.to_device(torch.nn.Linear(2, 2), device=META)
    assert moved(out.weight)


def test_in_place_to_returns_the_same_object():
    obj = MovesInPlace()
    out = st.to_device(obj, device=META)
    assert out is obj and moved(obj.x)


def test_dataclass_with_to_is_moved_by_to():
    out = st.to_device(MovesItself(torch.ones(2)), device=META)
    assert type(out) is MovesItself and out.moved_by_to and moved(out.x)


# --- to_device: autograd -------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu:0", CPU], ids=["str", "torch_device"])
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non_leaf"])
def test_requires_grad_keeps_the_autograd_link(no_xla, device, leaf):
    a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x = a if leaf else a * 2
    y = st.to_device(x, device=device)
    assert y.requires_grad
    (y * y).sum().backward()
    # d/da of x**2 is 2x * dx/da, with dx/da = 1 (leaf) or 2 (x = 2a)
    assert torch.equal(a.grad, 2 * x.detach() * (1 if leaf else 2))


# --- to_device: containers -----------------------------------------------------------------------


def test_dict_and_nested_dict():
    out = st.to_device({"a": torch.ones(1), "b": {"c": torch.ones(1)}}, device=META)
    assert type(out) is dict and moved(out["a"]) and moved(out["b"]["c"])


def test_list_and_tuple():
    out = st.to_device([torch.ones(1), (torch.ones(1), 3)], device=META)
    assert type(out) is list and type(out[1]) is tuple and moved(out[0]) and moved(out[1][0]) and out[1][1] == 3


@pytest.mark.parametrize("obj,want_type", [
    (Pair(torch.ones(1), torch.ones(2)), list),
    (Span(torch.ones(1), torch.ones(2)), tuple),
], ids=["list_subclass", "tuple_subclass"])
def test_sequence_subclass_that_cannot_be_rebuilt_falls_back(obj, want_type):
    out = st.to_device(obj, device=META)
    assert type(out) is want_type and len(out) == 2 and all(moved(t) for t in out)
    assert [t.shape for t in out] == [(1,), (2,)]


def test_sequence_subclass_that_can_be_rebuilt_keeps_its_type():
    out = st.to_device(Tokens([torch.ones(1), 7]), device=META)
    assert type(out) is Tokens and moved(out[0]) and out[1] == 7


def test_namedtuple_stays_a_namedtuple():
    out = st.to_device(Point(torch.ones(1), "y"), device=META)
    assert type(out) is Point and moved(out.x) and out.y == "y"


def test_defaultdict_keeps_default_factory():
    out = st.to_device(collections.defaultdict(list, a=torch.ones(1)), device=META)
    assert type(out) is collections.defaultdict and out.default_factory is list and moved(out["a"])
    assert out["missing"] == []


def test_ordereddict_keeps_order():
    out = st.to_device(collections.OrderedDict([("b", torch.ones(1)), ("a", 2)]), device=META)
    assert type(out) is collections.OrderedDict and list(out) == ["b", "a"] and moved(out["b"]) and out["a"] == 2


def test_mapping_that_cannot_be_built_from_a_dict_falls_back_to_dict():
    out = st.to_device(Registry("r", [("a", torch.ones(1))]), device=META)
    assert type(out) is dict and list(out) == ["a"] and moved(out["a"])


def test_mappingproxy_is_rebuilt_from_the_moved_dict():
    out = st.to_device(types.MappingProxyType({"a": torch.ones(1)}), device=META)
    assert type(out) is types.MappingProxyType and list(out) == ["a"] and moved(out["a"])


@pytest.mark.parametrize("value", ["text", b"bytes", 3, 2.5, None, True, object()])
def test_non_tensors_pass_through(value):
    assert st.to_device(value, device=META) is value


def test_nested_mix():
    batch = {
        "pairs": [Point(torch.ones(1), (torch.ones(2), "keep"))],
        "info": {"n": 3, "name": None},
        "dc": Plain(torch.ones(1), "dog"),
        "frames": collections.defaultdict(int, f=[torch.ones(3)]),
    }
    out = st.to_device(batch, device=META)
    point = out["pairs"][0]
    assert type(point) is Point and moved(point.x) and moved(point.y[0]) and point.y[1] == "keep"
    assert out["info"] == {"n": 3, "name": None}
    assert type(out["dc"]) is Plain and moved(out["dc"].x) and out["dc"].label == "dog"
    assert out["frames"].default_factory is int and moved(out["frames"]["f"][0])


# --- device specs: whatever torch.device accepts -------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cpu:0", CPU, torch.device("cpu", 0)],
                         ids=["str", "str_index", "torch_device", "torch_device_index"])
def test_to_device_accepts_torch_device_specs(no_xla, device):
    x = torch.arange(3)
    out = st.to_device(x, device=device)
    assert out.device.type == "cpu" and torch.equal(out, x)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)], ids=["str", "torch_device"])
def test_get_device_and_trainer_accept_torch_device_specs(no_xla, device):
    assert st.get_device(device).type == "cpu"
    trainer = st.SeamlessTPUTrainer(torch.nn.Linear(2, 1), device=device)
    assert trainer.device.type == "cpu" and trainer.to_device(torch.ones(3, 2)).device.type == "cpu"


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_string_without_cuda_is_a_runtime_error(cpu, device):
    with pytest.raises(RuntimeError, match=r"(?i)cuda"):
        st.get_device(device)
    with pytest.raises(RuntimeError, match=r"(?i)cuda"):
        st.SeamlessTPUTrainer(torch.nn.Linear(2, 1), device=device)


# --- sampling: every rank reads a disjoint part of what the user's sampler yields ---------------

DATA = list(range(100, 116))  # values differ from indices, so an index/value mix-up shows
BATCH = 2
WORLD = 2


def seeded():
    return torch.Generator().manual_seed(0)


class OddsDown(Sampler):
    """A custom sampler without __len__: odd indices, last first."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, 0, -2))


class SizedOddsDown(OddsDown):
    def __len__(self):
        return self.n // 2


SAMPLERS = {
    "subset_random": lambda: SubsetRandomSampler([1, 3, 4, 7, 8, 10, 13, 15], generator=seeded()),
    # Zero weight on the first half: any of 100..107 showing up came from outside the sampler.
    "weighted": lambda: WeightedRandomSampler([0.0] * 8 + [1.0] * 8, num_samples=8, generator=seeded()),
    "custom": lambda: SizedOddsDown(len(DATA)),
    "custom_without_len": lambda: OddsDown(len(DATA)),
}


def read_as_rank(monkeypatch, loader, rank, world=WORLD, drop_last=False):
    """What `rank` of `world` reads from `loader` once prepared: a flat list of samples, and the batch sizes."""
    monkeypatch.setattr(st, "_torch_dist_ranks", lambda: (world, rank))
    prepared = st._rebuild_loader(loader, drop_last, CPU)
    batches = [batch.tolist() for batch in prepared]
    return [x for b in batches for x in b], [len(b) for b in batches]


def strided(seq, rank):
    """The two ways to give `rank` its share: every WORLD-th sample, or every WORLD-th batch."""
    batches = [seq[i:i + BATCH] for i in range(0, len(seq), BATCH)]
    return seq[rank::WORLD], [x for b in batches[rank::WORLD] for x in b]


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_user_sampler_is_split_between_ranks(monkeypatch, name):
    make = SAMPLERS[name]
    want = [DATA[i] for i in make()]  # a fresh sampler with the same seed: what one process would read
    parts = [read_as_rank(monkeypatch, DataLoader(DATA, batch_size=BATCH, sampler=make()), r)[0] for r in range(WORLD)]
    assert sorted(parts[0] + parts[1]) == sorted(want), "the ranks together must read exactly the user's sampler"
    for rank, part in enumerate(parts):
        assert part in strided(want, rank), f"rank {rank} read {part}, not its stride of {want}"


@pytest.mark.parametrize("shuffle", [True, False], ids=["random", "sequential"])
def test_default_samplers_become_a_distributed_sampler(monkeypatch, shuffle):
    for rank in range(WORLD):
        monkeypatch.setattr(st, "_torch_dist_ranks", lambda: (WORLD, rank))
        out = st._rebuild_loader(DataLoader(DATA, batch_size=BATCH, shuffle=shuffle), False, CPU)
        sampler = out.sampler
        assert isinstance(sampler, DistributedSampler)
        assert (sampler.num_replicas, sampler.rank, sampler.shuffle) == (WORLD, rank, shuffle)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("as_batch_sampler", [False, True], ids=["sampler", "batch_sampler"])
def test_a_distributed_sampler_the_user_set_is_kept(monkeypatch, world, shuffle, as_batch_sampler):
    """An existing DDP script's own DistributedSampler is not split a second time: the ranks together
    read every sample once per epoch (before: half of them on 2 ranks)."""
    parts = []
    for rank in range(world):
        sampler = DistributedSampler(DATA, num_replicas=world, rank=rank, shuffle=shuffle, seed=3)
        loader = (DataLoader(DATA, batch_sampler=BatchSampler(sampler, BATCH, drop_last=False)) if as_batch_sampler
                  else DataLoader(DATA, batch_size=BATCH, sampler=sampler))
        parts.append(read_as_rank(monkeypatch, loader, rank, world)[0])
        assert parts[-1] == [DATA[i] for i in sampler], f"rank {rank} must read its sampler's share as given"
    seen = sorted(x for part in parts for x in part)
    assert set(seen) == set(DATA) and len(seen) == world * -(-len(DATA) // world), (
        "every sample, padded as DistributedSampler pads"
    )


def test_a_distributed_sampler_for_another_world_is_an_error(monkeypatch):
    loader = DataLoader(DATA, batch_size=BATCH, sampler=DistributedSampler(DATA, num_replicas=4, rank=1))
    with pytest.raises(
        ValueError, match=r"num_replicas=4, rank=1, but this process is rank 0 of 2; build it with those values"
    ):
        read_as_rank(monkeypatch, loader, 0, 2)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sampling", ["sequential", "shuffled", "custom"])
def test_loader_without_batching_is_split_between_ranks(monkeypatch, world, sampling):
    """DataLoader(ds, batch_size=None): each item is a step, as the dataset gives it (before: TypeError
    from inside the shim)."""
    def loader():
        if sampling == "custom":
            return DataLoader(DATA, batch_size=None, sampler=SizedOddsDown(len(DATA)))
        return DataLoader(DATA, batch_size=None, shuffle=sampling == "shuffled", generator=seeded())
    parts = []
    for rank in range(world):
        monkeypatch.setattr(st, "_torch_dist_ranks", lambda: (world, rank))
        items = list(st._rebuild_loader(loader(), False, CPU))
        assert all(type(x) is int for x in items), "each item as the dataset gives it: no batch is formed"
        parts.append([int(x) for x in items])
    want = [DATA[i] for i in SizedOddsDown(len(DATA))] if sampling == "custom" else DATA
    seen = [x for part in parts for x in part]
    assert set(seen) == set(want) and len({len(p) for p in parts}) == 1, f"every item, as many per rank: {parts}"


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep_last", "drop_last"])
def test_iterable_dataset_with_one_rank(monkeypatch, drop_last):
    seen, sizes = read_as_rank(monkeypatch, DataLoader(Stream(11), batch_size=BATCH), 0, world=1, drop_last=drop_last)
    assert seen == list(range(10 if drop_last else 11))
    assert sizes == [2] * 5 + ([] if drop_last else [1])


@pytest.mark.parametrize("n,drop_last", [(12, False), (11, False), (11, True)], ids=["even", "odd", "odd_drop_last"])
def test_iterable_dataset_is_split_between_ranks(monkeypatch, n, drop_last):
    parts = [
        read_as_rank(monkeypatch, DataLoader(Stream(n), batch_size=BATCH), r, drop_last=drop_last)[0]
        for r in range(WORLD)
    ]
    seen = parts[0] + parts[1]
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(n)), f"ranks overlap or invent samples: {parts}"
    missing = set(range(n)) - set(seen)
    # At most a remainder at the end of the stream may be dropped (to keep ranks in step).
    assert len(missing) < WORLD * BATCH and all(m >= n - WORLD * BATCH for m in missing), f"lost {sorted(missing)}"


def test_iterable_dataset_drop_last_gives_full_batches(monkeypatch):
    for rank in range(WORLD):
        _, sizes = read_as_rank(monkeypatch, DataLoader(Stream(11), batch_size=BATCH), rank, drop_last=True)
        assert sizes and all(s == BATCH for s in sizes), f"rank {rank} batch sizes {sizes}"
