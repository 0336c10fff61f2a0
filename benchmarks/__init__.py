"""The webds benchmark suite (``python -m benchmarks``) and the older single-purpose scripts
(``bench_*.py``), on one shared harness (:mod:`benchmarks.harness`). See docs/benchmarks.md."""
