"""``webds bench``: how fast the user's own shards read, decode and load, and what bounds it.

Three runs, each for a bounded time: reading (the tar stage alone, one process), reading and
decoding (one process), and a :class:`~webds.loader.WebLoader` with N workers making batches of
B. Each is measured with the per-stage probe (``stats=True``); the report names the bottleneck
(storage or network, tar parsing, decoding, the main process) and what to try.
:func:`run_bench` returns the report as a dict, which is what ``--json`` prints.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from ..base.workers import usable_cpus
from ..errors import ArgumentError
from ..shards.shardlists import expand_urls
from ..stages.probe import COLLATE, READING, WAITING, PipelineStats
from .common import add_inputs, add_quiet, positive_int, show_progress
from .shardio import close_iterator

__all__ = ["register", "run_bench", "bottleneck"]

EXAMPLE_BENCH = """example:
  webds bench 'data/train-{000000..000099}.tar' --workers 8 --batch-size 64
  webds bench s3://bucket/train/ --seconds 20 --json --storage-option anon=true

Runs three measurements, each for --seconds (reading the shards again if they run out first):
reading alone, reading and decoding in one process, and the whole loader with
--workers processes making batches of --batch-size. Prints samples/s and MB/s (bytes of the
shards) of each, where the time went, and one sentence naming the bottleneck with what to try.
Rates start at the first sample, so worker start-up is not counted."""


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand."""
    from . import add_command

    p = add_command(
        subparsers,
        "bench",
        help="measure reading, decoding and loading speed on your shards; name the bottleneck",
        description="Measure how fast your shards read, decode and load (with N workers), and "
        "say what bounds it.",
        epilog=EXAMPLE_BENCH,
        run=run,
    )
    add_inputs(p)
    p.add_argument(
        "--decode",
        default="pil",
        metavar="SPEC",
        help="decoder spec, as WebDataset.decode takes (default pil; e.g. rgb8, torchrgb)",
    )
    p.add_argument(
        "--workers", type=positive_int, default=None, metavar="N",
        help="DataLoader workers for the loader run (default: the CPU count, at most 8)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=positive_int, default=64, metavar="B",
        help="samples per batch in the loader run (default 64)",
    )  # fmt: skip
    p.add_argument(
        "--seconds", type=float, default=10.0, metavar="S",
        help="how long each of the three runs lasts (default 10)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="an fsspec storage option for remote shards (repeatable; a dotted KEY nests: "
        "client_kwargs.endpoint_url=http://...; VALUE is read as JSON when it parses)",
    )  # fmt: skip
    add_quiet(p)


def storage_options(pairs: Iterable[str]) -> Dict[str, Any]:
    """``["anon=true", "client_kwargs.region_name=eu"]`` -> ``{"anon": True, "client_kwargs":
    {"region_name": "eu"}}``."""
    options: Dict[str, Any] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key.strip():
            raise ArgumentError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        where = options
        *parents, last = key.strip().split(".")
        for part in parents:
            where = where.setdefault(part, {})
            if not isinstance(where, dict):
                raise ArgumentError(f"--storage-option {key}: {part} is already a value")
        where[last] = value
    return options


def _dataset(urls: List[str], options: Dict[str, Any], stats: bool) -> Any:
    from ..fluent import WebDataset

    # Several passes if the shards run out before the time does; the same order each time.
    return WebDataset(
        urls, shardshuffle=False, repeat=True, storage_options=options or None, stats=stats
    )


class _Clock:
    """Counts samples from the first one on, until ``seconds`` have passed since then."""

    def __init__(self, seconds: float, label: str, quiet: bool) -> None:
        self.seconds, self.samples, self.first = seconds, 0, None
        self.bar = None
        if show_progress(quiet):
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=round(seconds, 1), desc=label, unit="s", file=sys.stderr, leave=False
            )

    def tick(self, n: int) -> bool:
        """``n`` more samples; False once the time is up."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now  # the rate counts from here: start-up is not the steady state
            return True
        self.samples += n
        elapsed = now - self.first
        if self.bar is not None:
            self.bar.n = round(min(elapsed, self.seconds), 1)
            self.bar.set_postfix_str(f"{self.samples / max(elapsed, 1e-9):,.0f} samples/s")
        return elapsed < self.seconds

    def result(self, stats: PipelineStats) -> Dict[str, Any]:
        if self.bar is not None:
            self.bar.close()
        elapsed = time.perf_counter() - self.first if self.first is not None else 0.0
        nbytes = sum(s.nbytes for s in stats.stages if s.name == READING)
        rate = self.samples / elapsed if elapsed > 0 else 0.0
        # Bytes read over the whole run (a loader reads ahead of what it delivered): scaled to
        # the samples delivered.
        per_sample = nbytes / stats.samples if stats.samples else 0.0
        shares = {}
        for s in stats.summary():
            shares[s.name] = shares.get(s.name, 0.0) + s.share
        return {
            "samples": self.samples,
            "seconds": elapsed,
            "samples_per_s": rate,
            "mb_per_s": rate * per_sample / 1e6,
            "shares": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            "wait_s": stats.wait_seconds,
        }


def _run_one(
    dataset: Any, seconds: float, label: str, quiet: bool, fields: Optional[Set[str]] = None
) -> Dict[str, Any]:
    """Iterate ``dataset`` for ``seconds``; ``fields`` collects the field names of the first
    samples (what the advice about decoding depends on)."""
    clock = _Clock(seconds, label, quiet)
    it = iter(dataset)
    try:
        for item in it:
            if fields is not None and clock.samples < 200 and isinstance(item, dict):
                fields.update(name for name in item if not name.startswith("__"))
            if not clock.tick(len(item) if isinstance(item, list) else 1):
                break
    finally:
        close_iterator(it)
    return clock.result(dataset.stats())


def machine() -> Dict[str, Any]:
    """What the rates depend on: CPUs, Python, torch, webds."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        webds_version = version("webds")
    except PackageNotFoundError:  # run from a checkout that was never installed
        webds_version = "unknown"
    return {
        "cpus": usable_cpus(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "webds": webds_version,
    }


def run_bench(
    urls: List[str],
    *,
    decode: str = "pil",
    workers: Optional[int] = None,
    batch_size: int = 64,
    seconds: float = 10.0,
    options: Optional[Dict[str, Any]] = None,
    quiet: bool = True,
) -> Dict[str, Any]:
    """Measure ``urls`` three ways (see the module's docstring); the report as a dict."""
    from ..loader import WebLoader

    if not seconds > 0:
        raise ArgumentError(f"--seconds must be above 0, got {seconds}")
    cpus = usable_cpus()
    workers = workers or min(cpus, 8)
    options = options or {}
    fields: Set[str] = set()
    read = _run_one(_dataset(urls, options, True), seconds, "read", quiet, fields)
    decoded = _dataset(urls, options, True).decode(decode)
    decode_run = _run_one(decoded, seconds, "read+decode", quiet)
    dataset = _dataset(urls, options, False).decode(decode).batched(batch_size, collation_fn=None)
    loader = WebLoader(dataset, batch_size=None, num_workers=workers, stats=True)
    loader_run = _run_one(loader, seconds, f"loader ({workers} workers)", quiet)
    kind, sentence = bottleneck(read, decode_run, loader_run, workers, cpus, fields, len(urls))
    return {
        "shards": len(urls),
        "settings": {
            "decode": decode,
            "workers": workers,
            "batch_size": batch_size,
            "seconds": seconds,
        },
        "read": read,
        "decode": decode_run,
        "loader": loader_run,
        "fields": sorted(fields),
        "bottleneck": sentence,
        "bottleneck_kind": kind,
        "machine": machine(),
    }


def _largest(run: Dict[str, Any]) -> Tuple[str, float]:
    shares = {k: v for k, v in run["shares"].items() if k != WAITING}
    if not shares:
        return "", 0.0
    name = max(shares, key=shares.__getitem__)
    return name, shares[name]


def bottleneck(
    read: Dict[str, Any],
    decode: Dict[str, Any],
    loader: Dict[str, Any],
    workers: int,
    cpus: int,
    fields: Iterable[str] = (),
    shards: Optional[int] = None,
) -> Tuple[str, str]:
    """``(kind, sentence)``: what bounds the loader's rate, and what to try. ``kind`` is one of
    ``shards``, ``storage``, ``parsing``, ``decoding``, ``stage``, ``main process``, ``cpus``;
    ``fields`` are the samples' field names (the advice for decoding JPEGs is not the one for
    PNGs); ``shards`` how many shards there are (each worker reads whole shards)."""
    if shards is not None and shards < workers:
        idle = workers - shards
        return "shards", (
            f"Too few shards: {shards} for {workers} workers, so {idle} of them "
            f"{'has' if idle == 1 else 'have'} nothing to read; write more, smaller shards "
            f"(at least one per worker: webds split), or use --workers {shards}."
        )
    one = decode["samples_per_s"]
    got = loader["samples_per_s"]
    usable = min(workers, cpus)
    name, share = _largest(decode)
    scaled = one > 0 and got >= 0.7 * usable * one
    if workers > cpus and 0 < got < 0.7 * workers * one:
        return "cpus", (
            f"The CPUs: {workers} workers share {cpus} CPUs, so the loader ({got:,.0f} "
            f"samples/s) can't reach {workers} times one process ({one:,.0f}/s); use "
            f"--workers {cpus}, or a machine with more cores."
        )
    if not scaled and got > 0 and one > 0:
        wait = loader.get("wait_s") or 0.0
        if wait < 0.5 * loader["seconds"]:
            return "main process", (
                f"The main process: it waited for batches only {wait:.1f} s of "
                f"{loader['seconds']:.1f} s, so receiving them (unpickling, collation) bounds "
                f"the loader at {got:,.0f} samples/s; try larger batches, collate in the "
                "workers into tensors, and fewer Python objects per sample."
            )
        if name.startswith("reading"):
            return "storage", (
                f"Storage or network: the workers together read {loader['mb_per_s']:,.1f} MB/s "
                f"and wait for data; try more workers (more parallel reads), the shard cache "
                "(cache_dir=) for later epochs, a larger readahead, or shards closer to the "
                "machine."
            )
    if name.startswith("reading"):
        return "storage", (
            f"Storage or network: {100 * share:.0f}% of a worker's time is waiting for shard "
            f"data ({read['mb_per_s']:,.1f} MB/s in one process); try more workers (more "
            "parallel reads), the shard cache (cache_dir=) for later epochs, a larger readahead, "
            "or bigger shards (100 MB to 1 GB)."
        )
    if "tar parsing" in name:
        return "parsing", (
            f"Tar parsing: {100 * share:.0f}% of a worker's time goes to members "
            f"({read['samples_per_s']:,.0f} samples/s read in one process); try more workers, "
            "or fewer and larger fields per sample (pack small fields into one .json or .npy)."
        )
    if name.startswith("decode"):
        tips = [f"more workers (up to {cpus})"] if workers < cpus else []
        exts = {f.rpartition(".")[2].lower() for f in fields}
        if exts & {"jpg", "jpeg"}:
            tips.append("the fast JPEG decoder (pip install simplejpeg)")
        elif exts & {"png", "ppm", "bmp", "tif", "tiff"}:
            tips.append("JPEG instead of lossless images, which decode several times slower")
        tips.append("images stored at the size you train at")
        return "decoding", (
            f"Decoding: {100 * share:.0f}% of a worker's time ({one:,.0f} samples/s in one "
            f"process); try {', '.join(tips[:-1]) + ', or ' if len(tips) > 1 else ''}{tips[-1]}."
        )
    if name == COLLATE:
        return "main process", "Collation in the workers; try larger batches of tensors."
    return "stage", f"The stage {name}: {100 * share:.0f}% of a worker's time."


def _table(report: Dict[str, Any]) -> str:
    rows = [("read", report["read"]), ("read+decode", report["decode"])]
    rows.append((f"loader, {report['settings']['workers']} workers", report["loader"]))
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':<{width}}  {'samples/s':>11} {'MB/s':>9}  largest share"]
    for name, run in rows:
        stage, share = _largest(run)
        lines.append(
            f"{name:<{width}}  {run['samples_per_s']:11,.1f} {run['mb_per_s']:9,.1f}  "
            f"{stage} ({100 * share:.0f}%)"
        )
    m = report["machine"]
    lines.append(
        f"{report['shards']} shards; {m['cpus']} CPUs, Python {m['python']}, torch "
        f"{m['torch']}, webds {m['webds']}; decode {report['settings']['decode']!r}, batches "
        f"of {report['settings']['batch_size']}"
    )
    lines.append("")
    lines.append(f"Bottleneck: {report['bottleneck']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if "-" in args.inputs:
        raise ArgumentError("bench reads its shards several times: it can't read standard input")
    options = storage_options(args.storage_option)
    urls = [url for spec in args.inputs for url in expand_urls(spec, storage_options=options)]
    if not urls:
        raise ArgumentError("no input shards: give at least one path or URL")
    report = run_bench(
        urls,
        decode=args.decode,
        workers=args.workers,
        batch_size=args.batch_size,
        seconds=args.seconds,
        options=options,
        quiet=args.quiet or args.json,
    )
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0
