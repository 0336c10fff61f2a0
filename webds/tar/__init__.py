"""The tar format: reading members from a byte stream, writing them, and grouping the members of
one sample (``0001.jpg``, ``0001.cls``) into a sample dict.

- :mod:`~webds.tar.compression`: sniffing and decompressing gzip, bzip2 and xz shards.
- :mod:`~webds.tar.fields`: decoding header fields, checksums and extended headers (pax, GNU).
- :mod:`~webds.tar.reader`: ``read_members``, the streaming reader of tar members, and
  :mod:`~webds.tar.ending`: how a stream ends (``EndWithoutMarker``); :mod:`~webds.tar.budget`:
  its memory bounds (the largest member, a sample's budget, the longest name).
- :mod:`~webds.tar.writing`: encoding headers and writing members (``encode_header``,
  ``header_encoder``, ``member_bytes``, ``write_member``, ``END_OF_ARCHIVE``).
- :mod:`~webds.tar.grouper`: the grouping rules (``base_plus_ext``) in one generator,
  ``group_members``, which both readers below use.
- :mod:`~webds.tar.bulk`: ``bulk_groups``, the same grouping for runs of small plain members,
  checked a buffer at a time (the tar stage's fast path).
- :mod:`~webds.tar.grouping`: the stages from shard descriptors to samples one step at a time
  (``url_opener``, ``tar_file_expander``, ``group_by_keys``).
- :mod:`~webds.tar.samples`: ``tarfile_to_samples``, the same steps in one fast generator that
  reads planned sample ranges and keeps the pipeline's ledger.
"""
