"""webds: stream deep-learning training data from POSIX tar shards into PyTorch."""

__version__ = "0.1.0"
