"""Input and output: open a URL for reading or writing, and keep reading when the link drops.

- :mod:`~webds.io.urls`: one entry point, :func:`~webds.io.urls.open_url`, for paths, ``file:``,
  ``"-"``, ``pipe:`` commands, registered scheme handlers, and every fsspec filesystem.
- :mod:`~webds.io.remote`: opening through fsspec, and turning a backend's errors into
  :class:`~webds.errors.OpenError` s that say what to fix (credentials, endpoint, bucket).
- :mod:`~webds.io.streams`: the stream types (pipes, atomic outputs that appear only complete).
- :mod:`~webds.io.retrying`: resumable reads: a remote stream that reopens at the byte it
  reached, with backoff, when a read fails.
- :mod:`~webds.io.cache`: the local shard cache (a copy is kept only once it is complete).

Nothing here knows the tar format: the cache asks its caller whether a copy is complete.
"""
