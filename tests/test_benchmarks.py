"""The benchmark suite still runs end to end (``python -m benchmarks``, as the README says).

No time is asserted: this checks that every selected workload measures every contestant it
should, that the targets are judged from them, and that results.json and the plot are written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_quick_run_measures_every_contestant(tmp_path: Path) -> None:
    out = tmp_path / "out"
    only = "read-small,read-images,loader-1,write-small"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--reps", "1", "--only", only]
        + ["--data", str(tmp_path / "data"), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())

    assert list(result["workloads"]) == only.split(",")
    expected = {
        "read-small": {"bare reader loop", "webds WebDataset", "webds tarfile_to_samples"},
        "read-images": {
            "files Dataset",
            "zip Dataset",
            "bare reader loop",
            "shard bytes only, no samples",
            "webds WebDataset",
        },
        "loader-1": {"webds WebLoader", "files DataLoader", "zip DataLoader"},
        "write-small": {"webds TarWriter", "webds ShardWriter", "bare header writer"},
    }
    has_wds = importlib.util.find_spec("webdataset") is not None
    for name, must in expected.items():
        variants = result["workloads"][name]["variants"]
        assert must <= set(variants), (name, sorted(variants))
        assert any(v.startswith("webdataset") for v in variants) == has_wds
        for v, m in variants.items():
            assert m["median_per_s"] > 0 and m["count"] > 0 and len(m["times_s"]) == 1, (name, v)
    # Every pass of a reader sees every sample: the rates are of the same work.
    images = result["data"]["images"]["count"]
    for v, m in result["workloads"]["read-images"]["variants"].items():
        assert m["count"] == images * m["loops"], v

    targets = {t["name"]: t for t in result["targets"]}
    warm = targets["shards/file-per-sample, warm cache"]
    assert warm["status"] in ("PASS", "MISS")
    # Its reference: the shards' bytes read without making samples, against the same files.
    assert warm["reference"]["contestant"] == "bytes only" and warm["reference"]["value"] > 0
    against_wds = ("PASS", "MISS") if has_wds else ("SKIP",)
    assert targets["tar->samples small, webds/webdataset"]["status"] in against_wds
    assert targets["image pipeline 1 process, webds/webdataset"]["status"] == "SKIP"  # not run
    assert targets["image pipeline 1 process, webds/webdataset"]["reference"] is None
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loaders.png").stat().st_size > 0
    assert "== targets" in proc.stdout and "bytes only" in proc.stdout
