"""WebLoader's reused shared-memory batch buffers (webds.stages.batchbuffers): batches from
DataLoader workers arrive with every tensor of a batch in one reused buffer, values, dtypes and
shapes intact, batches the training loop keeps are never overwritten, fresh workers every epoch
start fresh buffers, and ``batch_buffers=False`` restores torch's own transfer."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import sample_members, write_tar
from test_batchmemory import same

import webds
from webds.stages.batchbuffers import MAX_SLOTS


@pytest.fixture
def spec(tmp_path):
    for i in range(4):
        write_tar(tmp_path / f"b-{i}.tar", sample_members(40, prefix=f"b{i}-"))
    return str(tmp_path / "b-{0..3}.tar")


def to_tensors(sample):
    """A sample as tensors of several dtypes and shapes (0-dim and empty ones too), a str and
    an int, all derived from its class number."""
    c = int(sample["cls"])
    return {
        "x": torch.arange(c, c + 12, dtype=torch.float32).reshape(3, 4),
        "y": torch.tensor(c, dtype=torch.int64),
        "m": torch.tensor([c % 2 == 0, c % 3 == 0]),
        "b": torch.full((5,), c % 256, dtype=torch.uint8),
        "e": torch.zeros(0, 2, dtype=torch.float64),
        "key": sample["__key__"],
    }


def collate(samples):
    return (
        torch.stack([s["x"] for s in samples]),
        {
            "y": torch.stack([s["y"] for s in samples]),
            "m": torch.stack([s["m"] for s in samples]),
            "b": torch.stack([s["b"] for s in samples]),
            "e": torch.stack([s["e"] for s in samples]),
        },
        [s["key"] for s in samples],
    )


def loader(spec, workers=2, **kw):
    ds = webds.WebDataset(spec).map(to_tensors).batched(8, collation_fn=collate)
    return webds.WebLoader(ds, batch_size=None, num_workers=workers, **kw)


def one_buffer(batch) -> bool:
    """Whether the batch's tensors lie side by side in one buffer (torch sends one segment
    each): ``y`` starts where ``x`` ends, rounded up to 64 bytes. Each has a storage of its own
    size over the buffer."""
    x, d, _ = batch
    own = x.untyped_storage().nbytes() == x.nbytes
    return own and d["y"].untyped_storage().data_ptr() == x.data_ptr() + -(-x.nbytes // 64) * 64


def check(batch):
    """The batch's values are what its keys say."""
    x, d, keys = batch
    assert x.dtype == torch.float32 and x.shape == (len(keys), 3, 4)
    for i, key in enumerate(keys):
        c = int(key[-6:])
        assert torch.equal(x[i], torch.arange(c, c + 12, dtype=torch.float32).reshape(3, 4))
        assert d["y"][i].item() == c and d["y"].dtype == torch.int64
        assert d["m"][i].tolist() == [c % 2 == 0, c % 3 == 0] and d["m"].dtype == torch.bool
        assert d["b"][i].tolist() == [c % 256] * 5
    assert d["e"].shape == (len(keys), 0, 2) and d["e"].dtype == torch.float64


def test_a_batch_arrives_in_one_reused_buffer(spec):
    batches = 0
    buffers = set()
    keys = []
    for batch in loader(spec):
        check(batch)
        x, d, k = batch
        keys += k
        # every tensor of the batch lies in one buffer, over a storage of its own size
        assert one_buffer(batch)
        for t in (x, d["y"], d["b"]):
            assert t.untyped_storage().nbytes() == t.nbytes
        ptr = x.untyped_storage().data_ptr()
        buffers.add(ptr)
        batches += 1
        del batch, x, d
    assert sorted(keys) == sorted(f"b{i}-{j:06d}" for i in range(4) for j in range(40))
    assert batches == 20
    assert len(buffers) <= 2 * MAX_SLOTS  # reused, not one per batch


def test_batches_kept_by_the_loop_are_never_overwritten(spec):
    ld = loader(spec, persistent_workers=True)  # the same workers, and buffers, next epoch
    kept = list(ld)  # more batches than a worker has buffers: the rest go as before
    assert len(kept) == 20 > MAX_SLOTS
    for batch in kept:
        check(batch)
    # Each of the 2 workers made 10 batches: 8 in its buffers, all kept busy, then 2 as before.
    assert sum(one_buffer(b) for b in kept) == 2 * MAX_SLOTS
    views = [(b[2][1], b[0][1]) for b in kept]  # only a view of each batch survives
    del kept, batch
    again = list(ld)  # the workers would reuse any buffer freed under a view
    for batch in again:
        check(batch)
    assert len(views) == 20
    for key, view in views:
        c = int(key[-6:])
        assert torch.equal(view, torch.arange(c, c + 12, dtype=torch.float32).reshape(3, 4)), key


def test_fresh_workers_every_epoch_and_persistent_ones(spec):
    for persistent in (False, True):
        ld = loader(spec, persistent_workers=persistent)
        for _ in range(3):
            n = 0
            for batch in ld:
                check(batch)
                assert one_buffer(batch)
                n += len(batch[2])
            assert n == 160


def test_batch_buffers_false_keeps_torchs_transfer(spec):
    for batch in loader(spec, batch_buffers=False):
        check(batch)
        assert not one_buffer(batch)


def test_pin_memory_without_an_accelerator_keeps_the_buffers(spec):
    # torch pins nothing without an accelerator (it warns): the batches come in the buffers.
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: torch pins the batches")
    n = 0
    with pytest.warns(UserWarning, match="no accelerator"):
        for batch in loader(spec, pin_memory=True):  # (each let go: its buffer is free again)
            check(batch)
            assert one_buffer(batch)
            n += len(batch[2])
    assert n == 160


def test_resume_is_exact_with_buffers(spec):
    from test_resume import assert_exact

    packed = []

    def keys(batch):
        check(batch)
        packed.append(one_buffer(batch))
        return (batch[2],)

    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=2).map(to_tensors)
        ds = ds.batched(8, collation_fn=collate)
        return webds.WebLoader(ds, batch_size=None, num_workers=2).map(keys)

    for k in (1, 7):
        assert_exact(make, k)
    assert len(packed) > 40 and all(packed)


def test_batches_that_grow_get_bigger_buffers(tmp_path):
    # Each batch is larger than the one before: the worker grows a free buffer (or makes one)
    # and the main process must read the new memory, not the old.
    url = str(write_tar(tmp_path / "grow.tar", sample_members(60)))

    def grow(batch):
        n = int(batch[0]["cls"])
        return (torch.full((n + 1, 1000), float(n)), torch.tensor([n]))

    ds = webds.WebDataset(url).batched(3, collation_fn=None).map(grow)
    for workers in (1, 2):
        seen = []
        for x, y in webds.WebLoader(ds, batch_size=None, num_workers=workers):
            n = int(y)
            assert one_buffer((x, {"y": y}, []))  # dropped as it goes: buffers are reused
            assert x.shape == (n + 1, 1000) and bool((x == n).all())
            seen.append(n)
        assert sorted(seen) == list(range(0, 60, 3))


def test_short_shared_memory_sends_batches_the_usual_way(monkeypatch):
    """When a slot can't be made (a container's small /dev/shm), the batch goes torch's way and
    the pool makes no more slots; nothing is lost."""
    from webds.stages import batchbuffers

    pool = batchbuffers.SlotPool()
    first = pool.pack((torch.arange(6),))
    assert isinstance(first, batchbuffers.Packed)

    def no_space(self):
        raise RuntimeError("unable to write to file </torch_1>: No space left on device (28)")

    monkeypatch.setattr(torch.Tensor, "share_memory_", no_space)
    batch = (torch.ones(1000),)
    assert pool.pack(batch) is batch  # slot 0 is busy and no other can be made
    assert not pool.can_grow


class Tagged(torch.Tensor):
    """A tensor subclass with an attribute, as torchvision's tv_tensors are."""

    @staticmethod
    def __new__(cls, data, tag):
        t = torch.Tensor._make_subclass(cls, data)
        t.tag = tag
        return t

    def __reduce_ex__(self, protocol):
        return (_tagged, (self.as_subclass(torch.Tensor).clone(), self.tag))


def _tagged(data, tag):
    return Tagged(data, tag)


def test_tensor_subclasses_arrive_as_sent(spec):
    # A subclass and its attributes would be lost in the shared buffer: such batches go torch's
    # way (they came back as plain tensors: issue 36).
    def boxes(samples):
        c = torch.tensor([int(s["cls"]) for s in samples], dtype=torch.float32)
        return Tagged(c.unsqueeze(1).repeat(1, 4), tag=(64, 48)), [s["__key__"] for s in samples]

    ds = webds.WebDataset(spec, shardshuffle=False).batched(8, collation_fn=boxes)
    got = list(webds.WebLoader(ds, batch_size=None, num_workers=2))
    assert len(got) == 20
    for b, keys in got:
        assert type(b) is Tagged and b.tag == (64, 48)
        assert b[:, 0].tolist() == [float(k[-6:]) for k in keys]
    import importlib

    from torchvision_cpu import import_torchvision

    import_torchvision()
    tv = importlib.import_module("torchvision.tv_tensors")

    def tv_boxes(samples):
        xyxy = torch.tensor([[0, 0, 4, int(s["cls"]) % 7 + 1] for s in samples])
        return tv.BoundingBoxes(xyxy, format="XYXY", canvas_size=(64, 48))

    ds = webds.WebDataset(spec, shardshuffle=False).batched(8, collation_fn=tv_boxes)
    for b in webds.WebLoader(ds, batch_size=None, num_workers=2):
        assert type(b) is tv.BoundingBoxes and tuple(b.canvas_size) == (64, 48)


def test_a_tensor_of_a_batch_costs_its_own_bytes_to_save(spec):
    # Labels out of a batch of images: saved, pickled or copied, one costs its own size (it was
    # the whole batch's storage, 198 KB for 16 labels of 16 3x64x64 images: issue 36).
    import copy
    import io
    import pickle

    def images(samples):
        c = torch.tensor([int(s["cls"]) for s in samples])
        return torch.zeros(len(samples), 3, 64, 64), c

    ds = webds.WebDataset(spec, shardshuffle=False).batched(16, collation_fn=images)
    loader = webds.WebLoader(ds, batch_size=None, num_workers=2)
    for x, labels in loader:
        assert one_buffer((x, {"y": labels}, None))  # still carried in one shared buffer
        buf = io.BytesIO()
        torch.save(labels, buf)
        assert len(buf.getvalue()) < 4096
        assert len(pickle.dumps(labels)) < 4096
        assert copy.deepcopy(labels).untyped_storage().nbytes() == labels.nbytes
        break


def test_two_live_iterators_of_one_loader(spec):
    # zip(loader, loader) and two iterators advanced in turn (it raised "iterate from one
    # process", which did not apply: issue 36).
    lo = loader(spec)
    pairs = list(zip(lo, lo))
    assert len(pairs) == 20
    for a, b in pairs:
        check(a)
        check(b)
    first, second = iter(lo), iter(lo)
    seen = []
    for _ in range(6):
        for it in (first, second):
            batch = next(it)
            check(batch)
            seen.append(batch[2])
    assert len(seen) == 12


Pair = collections.namedtuple("Pair", "a b")


def _random_tree(rng, depth=0):
    """A batch as collation functions make them: tuples, lists and dicts of tensors (of several
    dtypes, empty and 0-dim ones too, the same tensor twice), lists of keys, bytes and numbers,
    a namedtuple, a tensor subclass, None."""
    kinds = ["tensor"] * 4 + ["keys", "bytes", "number", "none", "pair"]
    if depth < 3:
        kinds += ["tuple", "list", "dict"] * (4 if depth == 0 else 2)
    kind = "tagged" if rng.random() < 0.02 else rng.choice(kinds)
    if kind == "tensor":
        dtype = rng.choice([torch.float32, torch.int64, torch.uint8, torch.bool, torch.float16])
        shape = rng.choice([(), (0,), (3,), (2, 5), (4, 0, 2)])
        return (torch.rand(shape) * 100).to(dtype)
    if kind == "keys":
        return [f"{rng.randrange(10**6):08d}" for _ in range(rng.randint(0, 6))]
    if kind == "bytes":
        return [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(0, 6))]
    if kind == "number":
        return rng.choice([1, 2.5, True])
    if kind == "none":
        return None
    if kind == "pair":
        return Pair(torch.arange(3), "x")
    if kind == "tagged":
        return Tagged(torch.ones(2), tag=rng.randrange(9))
    items = [_random_tree(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if rng.random() < 0.2 and items and isinstance(items[0], torch.Tensor):
        items.append(items[0])  # the same tensor twice
    if kind == "dict":
        return {f"k{i}": x for i, x in enumerate(items)}
    return tuple(items) if kind == "tuple" else items


@pytest.mark.parametrize("case", range(200))
def test_random_batches_come_back_as_they_were_packed(case):
    """Packed in a worker's slot and rebuilt in the main process (as the DataLoader's queue
    carries them: pickled), a random batch is the batch it was: every container of the same
    type with the same items, every tensor with its dtype, shape and values, a tensor sent
    twice one tensor; a batch with a tensor subclass or nothing to pack is sent as it is."""
    import pickle
    import random

    from webds.stages.batchbuffers import Packed, SlotPool, Unpacker

    rng = random.Random(case)
    batch = _random_tree(rng)
    pool, unpacker = SlotPool(), Unpacker()
    for _ in range(2):  # the second time in a slot the main process holds already
        packed = pool.pack(batch)
        assert isinstance(packed, Packed) == _packs(batch)
        if not isinstance(packed, Packed):
            assert packed is batch
            return
        got = unpacker.unpack(0, pickle.loads(pickle.dumps(packed)))
        same(batch, got)


def _packs(batch):
    """Whether a batch is packed: it holds a plain tensor in plain tuples, lists and dicts, and
    no tensor subclass there."""
    found = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append(type(x) is torch.Tensor)
        elif type(x) in (tuple, list):
            for y in x:
                walk(y)
        elif type(x) is dict:
            for y in x.values():
                walk(y)

    walk(batch)
    return bool(found) and all(found)


def test_random_batches_are_mostly_packed():
    """Not vacuous: most of the random batches above are packed."""
    import random

    packed = sum(_packs(_random_tree(random.Random(case))) for case in range(200))
    assert 60 < packed < 200


def test_plain_containers_beside_tensors_arrive_from_workers_as_sent(spec):
    """One step off the random trees (in one process): through 2 DataLoader workers, batches
    whose containers without tensors (keys, bytes, a dict of metadata lists, a tuple of
    labels) travel as they are beside packed tensors arrive as with batch_buffers=False, and
    the tensors still in one buffer."""

    def rich(samples):
        x = torch.stack([torch.full((3,), float(int(s["cls"]))) for s in samples])
        meta = {"keys": [s["__key__"] for s in samples], "raw": [s["cls"] for s in samples]}
        return (x, meta, tuple(int(s["cls"]) for s in samples), {"y": x.sum(1), "m": meta})

    def load(**kw):
        ds = webds.WebDataset(spec, shardshuffle=False).batched(8, collation_fn=rich)
        return webds.WebLoader(ds, batch_size=None, num_workers=2, **kw)

    unpacked = list(load(batch_buffers=False))
    count = 0
    for a, b in zip(load(), unpacked):  # (each batch let go: its buffer is free again)
        same(a, b)
        x, y = a[0], a[3]["y"]
        assert y.untyped_storage().data_ptr() == x.data_ptr() + -(-x.nbytes // 64) * 64
        count += 1
    assert count == len(unpacked) == 20
