"""The tar format: reading members from a byte stream, writing them, and grouping the members of
one sample (``0001.jpg``, ``0001.cls``) into a sample dict.

- :mod:`~webds.tar.tario`: header parsing and encoding, compressed shards, members.
- :mod:`~webds.tar.samples`: the stages from shard descriptors to samples (``url_opener``,
  ``tar_file_expander``, ``group_by_keys``, ``tarfile_to_samples``).
"""
