"""The foundation every room builds on; it imports nothing of webds but :mod:`webds.errors`.

- :mod:`~webds.base.stage`: ``@stage``, :class:`~webds.base.stage.Stage`, the count rules
  (``SAME``, ``REORDER``, ``BATCH``, ``UNBATCH``) and what each stage owes a resume.
- :mod:`~webds.base.handlers`: what a stage does with an exception (``warn_and_continue``, ...).
- :mod:`~webds.base.ledger`, :mod:`~webds.base.slots`, :mod:`~webds.base.saved`: the record of
  what a pass has read and holds, and the typed saved state, on which resuming is built.
- :mod:`~webds.base.redact`: credentials hidden in what webds shows (messages, reprs, logs); it
  imports nothing, so :mod:`webds.errors` builds on it.
- :mod:`~webds.base.workers`: which rank and DataLoader worker this process is, and seeds derived
  from (seed, epoch, rank, ...) that every process agrees on.
"""
