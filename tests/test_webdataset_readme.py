# ruff: noqa: B007, UP031  (the examples keep webdataset's README code as it was written)
"""The examples of webdataset's README, run unchanged after ``import webds as wds``.

The only edits: local shards instead of the remote URLs, small images (64x64, patches of 16
instead of 256) so the suite stays fast, and a seeded ``randrange`` in ``get_patches``.
"""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import torch
import torch.utils.data
from conftest import write_tar
from PIL import Image

import webds as wds

N_SHARDS, PER_SHARD, SIDE, PATCH = 4, 12, 64, 16


def png(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (SIDE, SIDE, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """Publaynet-like shards: a PNG page and a JSON annotation per sample."""
    d = tmp_path_factory.mktemp("readme")
    for s in range(N_SHARDS):
        members = []
        for i in range(PER_SHARD):
            key = f"{s:02d}{i:04d}"
            ann = {"annotations": [{"category_id": (s + i) % 5}]} if i % 3 else {}
            members.append((f"{key}.png", png(s * 100 + i)))
            members.append((f"{key}.big.jpg", png(s * 100 + i)))
            members.append((f"{key}.json", json.dumps(ann).encode()))
        write_tar(d / f"publaynet-train-{s:06d}.tar", members)
    return str(d / f"publaynet-train-{{000000..{N_SHARDS - 1:06d}}}.tar")


def preprocess(sample):
    image, json = sample
    try:
        label = json["annotations"][0]["category_id"]
    except Exception:
        label = 0
    return 1 - image, label


rng = random.Random(0)


def get_patches(src):
    for sample in src:
        image, label = sample
        h, w = image.shape[:2]
        for _ in range(16):
            y, x = rng.randrange(h - PATCH), rng.randrange(w - PATCH)
            patch = image[y : y + PATCH, x : x + PATCH]
            yield (patch, label)


def test_readme_fluent_dataset(url):
    dataset = wds.WebDataset(url).shuffle(1000).decode("rgb").to_tuple("png", "json")
    assert isinstance(dataset, torch.utils.data.IterableDataset)
    for image, meta in dataset:
        break
    assert image.shape == (SIDE, SIDE, 3) and image.dtype == np.float32
    assert isinstance(meta, dict)
    dataset = dataset.map(preprocess)
    for image, label in dataset:
        break
    assert 0.0 <= image.min() and image.max() <= 1.0 and isinstance(label, int)


def test_readme_expanding_samples_and_dataloader(url):
    dataset = wds.WebDataset(url).shuffle(1000).decode("rgb").to_tuple("png", "json")
    dataset = dataset.map(preprocess)
    dataset = dataset.compose(get_patches).shuffle(10000)
    for image, _ in dataset:
        break
    assert image.shape == (PATCH, PATCH, 3)

    loader = torch.utils.data.DataLoader(dataset, num_workers=2, batch_size=8)
    batch = next(iter(loader))
    assert batch[0].shape == (8, PATCH, PATCH, 3) and batch[1].shape == (8,)

    loader = wds.WebLoader(dataset, num_workers=2, batch_size=8)
    loader = loader.unbatched().shuffle(1000).batched(12)
    batch = next(iter(loader))
    assert batch[0].shape == (12, PATCH, PATCH, 3) and batch[1].shape == (12,)


def test_readme_complete_pipeline(url):
    dataset = (
        wds.WebDataset(url).shuffle(1000).decode("rgb").to_tuple("png", "json").map(preprocess)
    )
    dataset = dataset.compose(get_patches)
    dataset = dataset.batched(16)
    loader = wds.WebLoader(dataset, num_workers=2, batch_size=None)
    loader = loader.unbatched().shuffle(1000).batched(12)
    total = 0
    for batch in loader:
        assert batch[0].shape[1:] == (PATCH, PATCH, 3)
        total += len(batch[1])
    assert total == N_SHARDS * PER_SHARD * 16


def test_readme_pipeline_interface(url):
    dataset = wds.DataPipeline(
        wds.SimpleShardList(url),
        wds.shuffle(100),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(1000),
        wds.decode("torchrgb"),
        lambda src: ((s["big.jpg"], s["json"]) for s in src),
        wds.shuffle(10000),
        wds.batched(16),
    )
    batch = next(iter(dataset))
    assert batch[0].shape == (16, 3, SIDE, SIDE) and len(batch[1]) == 16


def test_readme_pipeline_to_tuple_with_multi_dot_extension(url):
    dataset = wds.DataPipeline(
        wds.SimpleShardList(url),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.decode("torchrgb"),
        wds.to_tuple("big.jpg", "json"),
        wds.batched(16),
    )
    images, metas = next(iter(dataset))
    assert images.shape == (16, 3, SIDE, SIDE) and isinstance(metas[0], dict)


def test_readme_multinode_resampled(url):
    dataset = (
        wds.WebDataset(url, resampled=True)
        .shuffle(1000)
        .decode("rgb")
        .to_tuple("png", "json")
        .map(preprocess)
        .with_epoch(100)
    )
    assert sum(1 for _ in dataset) == 100
    sample = next(iter(dataset))
    assert sample[0].shape == (SIDE, SIDE, 3)

    dataset = wds.DataPipeline(
        wds.ResampledShards(url),
        wds.tarfile_to_samples(),
        wds.shuffle(1000),
        wds.decode("torchrgb"),
        wds.to_tuple("big.jpg", "json"),
        wds.batched(16),
    ).with_epoch(5)
    batches = list(dataset)
    assert len(batches) == 5 and batches[0][0].shape == (16, 3, SIDE, SIDE)


def test_readme_writing_and_reading_back(tmp_path):
    with wds.TarWriter(str(tmp_path / "dest.tar")) as sink:
        for index in range(10):
            sink.write(
                {
                    "__key__": "sample%06d" % index,
                    "input.pyd": {"x": index},
                    "output.pyd": [index, index * 2],
                }
            )
    ds = wds.WebDataset(str(tmp_path / "dest.tar")).decode(allow_pickle=True)
    got = [(s["input.pyd"], s["output.pyd"]) for s in ds]
    assert got == [({"x": i}, [i, 2 * i]) for i in range(10)]


def test_readme_v01_imagenet_example(url):
    """webdataset 0.1's README: the keyword style with torchvision transforms."""
    tv = pytest.importorskip("torchvision_cpu").import_torchvision()
    transforms = tv.transforms

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    preproc = transforms.Compose(
        [
            transforms.RandomResizedCrop(32),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    path = url  # local shards with png + json instead of ImageNet's jpg;png + cls
    with pytest.warns(DeprecationWarning, match="to_tuple"):
        dataset = wds.WebDataset(
            path,
            decoder="pil",
            extensions="jpg;png json",
            transforms=[preproc, lambda x: len(x) - 1],
        )
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=2)
    seen = 0
    for xs, ys in loader:
        assert xs.shape[1:] == (3, 32, 32) and xs.dtype == torch.float32
        assert ys.shape == xs.shape[:1]
        seen += len(xs)
    assert seen == N_SHARDS * PER_SHARD
