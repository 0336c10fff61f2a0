"""What a resumable position costs, for a 1M-sample index: ``python -m benchmarks.bench_resume``.

Builds 1000 shards of 1000 one-member samples (one tar written, the others links to it) and their
index, then runs ``WebLoader(WebDataset(index).shuffle(N).batched(64), num_workers=2)`` for a few
batches and measures, for shuffle buffers of 1000 and 10000 samples:

- the size of ``state_dict()`` as JSON, and the time of ``state_dict()`` and of
  ``json.dumps``;
- the time of ``load_state_dict()`` in a fresh loader, and from there to its first batch (the
  held samples read again and put back in their places);
- steady throughput (batches/s over 200 batches) of the same loader, for reference.

Writes ``benchmarks/results/resume.json`` (or ``--out``). Timings are medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import webds
from webds.shards.index import ShardIndex

SHARDS, PER_SHARD = 1000, 1000


def build(root: Path) -> str:
    """The shards (one written, the rest links to it) and their index; the index's path."""
    first = root / "s-0000.tar"
    with tarfile.open(first, "w", format=tarfile.USTAR_FORMAT) as tf:
        for j in range(PER_SHARD):
            data = str(j).encode()
            info = tarfile.TarInfo(f"{j:06d}.cls")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    urls = [str(first)]
    for k in range(1, SHARDS):
        link = root / f"s-{k:04d}.tar"
        os.link(first, link)
        urls.append(str(link))
    index = root / "index.json"
    ShardIndex.build(urls).save(str(index))
    return str(index)


def loader(index: str, bufsize: int) -> webds.WebLoader:
    dataset = webds.WebDataset(index, shardshuffle=True, seed=0).shuffle(bufsize).batched(64)
    return webds.WebLoader(dataset, batch_size=None, num_workers=2)


def measure(index: str, bufsize: int, reps: int) -> Dict[str, Any]:
    saves, dumps, loads, firsts, sizes = [], [], [], [], []
    for _ in range(reps):
        a = loader(index, bufsize)
        it = iter(a)
        for _ in range(2 * bufsize // 64 + 5):  # past the buffers' first fill
            next(it)
        start = time.perf_counter()
        state = a.state_dict()
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        text = json.dumps(state)
        dumps.append(time.perf_counter() - start)
        sizes.append(len(text))
        del it
        b = loader(index, bufsize)
        start = time.perf_counter()
        b.load_state_dict(json.loads(text))
        loads.append(time.perf_counter() - start)
        start = time.perf_counter()
        next(iter(b))
        firsts.append(time.perf_counter() - start)
    steady = loader(index, bufsize)
    it = iter(steady)
    for _ in range(20):
        next(it)
    start = time.perf_counter()
    for _ in range(200):
        next(it)
    rate = 200 / (time.perf_counter() - start)
    return {
        "shuffle": bufsize,
        "state_bytes": statistics.median(sizes),
        "state_dict_s": statistics.median(saves),
        "json_dumps_s": statistics.median(dumps),
        "load_state_dict_s": statistics.median(loads),
        "first_batch_after_load_s": statistics.median(firsts),
        "steady_batches_per_s": rate,
    }


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "resume.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        index = build(Path(tmp))
        rows = [measure(index, n, args.reps) for n in (1000, 10000)]
    for row in rows:
        ms = {k: v * 1000 for k, v in row.items() if k.endswith("_s")}
        print(
            f"shuffle({row['shuffle']}): state {row['state_bytes'] / 1024:.1f} KiB, "
            f"state_dict {ms['state_dict_s']:.1f} ms, json {ms['json_dumps_s']:.1f} ms, "
            f"load_state_dict {ms['load_state_dict_s']:.1f} ms, first batch after "
            f"{ms['first_batch_after_load_s']:.0f} ms, "
            f"steady {row['steady_batches_per_s']:.0f} batches/s"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"samples": SHARDS * PER_SHARD, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
