"""Functions for map_shards tests, at module top level so worker processes (the default process
pool, Dask workers) can import them by name."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

Sample = Dict[str, Any]


def upper(sample: Sample) -> Sample:
    """str and int fields, so the writer's default encoder is exercised."""
    return {"txt": sample["txt"].decode().upper(), "cls": int(sample["cls"]) + 1}


def keep_bytes(sample: Sample) -> Sample:
    return sample


def drop_odd(sample: Sample) -> Optional[Sample]:
    return None if int(sample["cls"]) % 2 else sample


def split_two(sample: Sample) -> List[Sample]:
    key = sample["__key__"]
    return [{"__key__": f"{key}_a", "txt": sample["txt"]}, {"__key__": f"{key}_b", "cls": 7}]


def returns_text(sample: Sample) -> str:
    return "not a sample"


def fail_in_shard_1(sample: Sample) -> Sample:
    """Fails on the third sample of shards whose name contains '-001', after two were written."""
    if "-001" in sample["__url__"] and sample["__key__"].endswith("2"):
        raise ValueError(f"cannot handle {sample['__key__']}")
    return upper(sample)


def number_samples(samples: Iterator[Sample]) -> Iterator[Sample]:
    """Shard level: each sample gets its position in the shard as field 'index'."""
    for i, sample in enumerate(samples):
        yield {"__key__": sample["__key__"], "txt": sample["txt"], "index": i}
