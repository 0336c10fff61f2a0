"""Input and output: open a URL for reading or writing, and keep reading when the link drops.

- :mod:`~webds.io.urls`: one entry point, :func:`~webds.io.urls.open_url`, for paths, ``file:``,
  ``"-"``, ``pipe:`` commands, registered scheme handlers, and every fsspec filesystem.
- :mod:`~webds.io.retrying`: resumable reads: a remote stream that reopens at the byte it
  reached, with backoff, when a read fails.
- :mod:`~webds.io.cache`: the local shard cache (a copy is kept only once it is complete).

Nothing here knows about tar, samples or stages beyond the stage machinery.
"""
