"""Benchmark: reading one shard from S3 with webds against raw boto3, on a loopback moto server.

Starts moto's ``ThreadedMotoServer`` on 127.0.0.1, uploads one ~100 MB shard of image-sized
members (random bytes, 40-250 KB), then measures in the same run, several times each, and
reports the median MB/s:

- ``boto3``: ``get_object(...)["Body"].read()`` of the whole object: the ceiling for one
  sequential stream from this server;
- ``webds``: ``tarfile_to_samples`` over the ``s3://`` URL with ``storage_options``, reading
  every member of every sample (open_url's defaults: read-ahead cache, its block size);
- ``webds block=N``: the same with ``block_size=N`` in ``storage_options``, to show how the
  read block size moves throughput, next to ``boto3 ranged GETs of N``: boto3 fetching the
  object block by block as fsspec does (moto serves every ranged GET by reading the whole
  object, so on moto the number of requests, not webds, sets the pace).

The ratio webds/boto3 is the number to watch (target >= 0.7). moto runs in this process, so both
sides share its cost; absolute MB/s say little about real S3.

Usage: ``python benchmarks/bench_s3.py [--reps 5] [--mb 100] [--out benchmarks/results/s3.json]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Variant, machine_info, measure, moto_s3, write_json  # noqa: E402
from webds.tar.samples import tarfile_to_samples  # noqa: E402
from webds.tar.writing import END_OF_ARCHIVE, member_bytes  # noqa: E402

BUCKET = "webds-bench"
KEY = "train/shard-000000.tar"
MiB = 2**20


def build_shard(total_mb: int) -> bytes:
    """A tar of (jpg, cls) samples with image-sized random payloads, ``total_mb`` MB in all."""
    rng = random.Random(0)
    blob = os.urandom(1 << 20)
    parts: List[bytes] = []
    size = 0
    i = 0
    while size < total_mb * 1_000_000:
        n = rng.randint(40_000, 250_000)
        start = rng.randint(0, len(blob) - n)
        key = f"{i:07d}"
        parts.append(member_bytes(f"{key}.jpg", blob[start : start + n], mtime=1_700_000_000))
        parts.append(member_bytes(f"{key}.cls", str(i % 1000).encode(), mtime=1_700_000_000))
        size += n + 1536
        i += 1
    parts.append(END_OF_ARCHIVE)
    return b"".join(parts)


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mb", type=int, default=100, help="shard size in MB")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "s3.json"))
    ap.add_argument(
        "--block-sizes", default="8,32,128", help="MiB values for the block_size variants"
    )
    args = ap.parse_args(argv)

    with moto_s3() as s3:
        client = s3["client"]
        client.create_bucket(Bucket=BUCKET)
        data = build_shard(args.mb)
        client.put_object(Bucket=BUCKET, Key=KEY, Body=data)
        nobject = len(data)
        del data
        options = s3["storage_options"]
        url = f"s3://{BUCKET}/{KEY}"

        def run_boto3() -> int:
            return len(client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read())

        # Payload bytes webds hands over; the object also holds headers and padding, so the
        # MB/s below are computed over the object size for both, like for like.
        payload = 0

        def run_webds(**extra: Any) -> Callable[[], int]:
            def run() -> int:
                nonlocal payload
                total = 0
                for sample in tarfile_to_samples(**options, **extra)([{"url": url}]):
                    total += len(sample["jpg"]) + len(sample["cls"])
                payload = total
                return nobject

            return run

        def run_boto3_ranged(block: int) -> Callable[[], int]:
            # What any block-wise reader (fsspec's caches) asks of the server: one ranged GET
            # per block. moto answers each by reading the whole object, so this is slow here
            # in a way real S3 is not; it separates the server's cost from webds's.
            def run() -> int:
                total = 0
                while total < nobject:
                    rng = f"bytes={total}-{min(total + block, nobject) - 1}"
                    body = client.get_object(Bucket=BUCKET, Key=KEY, Range=rng)["Body"].read()
                    total += len(body)
                return total

            return run

        variants: Dict[str, Any] = {
            # The first call warms up connections on both sides.
            "boto3 get_object().read()": Variant(run_boto3),
            "webds tarfile_to_samples": Variant(run_webds()),
        }
        for mib in [int(x) for x in args.block_sizes.split(",") if x.strip()]:
            variants[f"webds block_size={mib} MiB"] = run_webds(block_size=mib * MiB)
            variants[f"boto3 ranged GETs of {mib} MiB"] = run_boto3_ranged(mib * MiB)
        runs = measure(variants, args.reps, workload="s3", unit="bytes/s")

    base = runs["boto3 get_object().read()"].median
    results: Dict[str, Any] = {}
    for name, m in runs.items():
        if m.count != nobject:
            raise RuntimeError(f"{name} read {m.count} bytes, expected {nobject}")
        results[name] = {
            **m.to_json(),
            "mb_per_s": m.median / 1e6,
            "ratio_to_boto3": m.median / base,
        }
    report = {
        **machine_info(["boto3", "moto", "s3fs", "fsspec"]),
        "reps": args.reps,
        "object_bytes": nobject,
        "payload_bytes": payload,
        "server": "moto ThreadedMotoServer on 127.0.0.1 (same process)",
        "results": results,
        "ratio_webds_to_boto3": results["webds tarfile_to_samples"]["ratio_to_boto3"],
    }
    for name, entry in results.items():
        print(f"{name:36s} {entry['mb_per_s']:8.1f} MB/s  x{entry['ratio_to_boto3']:.2f}")
    out = write_json(args.out, report)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
