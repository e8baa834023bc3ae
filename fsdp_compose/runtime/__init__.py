"""The runtime core, one layer: hooks drive groups, groups drive collectives.

``hooks`` (forward/backward hook functions) and ``schedule`` (execution order, prefetch)
read and write ``state`` (plain data); a ``group`` unshards, reshards and reduces its
``params`` with the batched ``collectives``, agreed on by ``handshake``. Nothing here knows
about state dicts, checkpoints or wrapping policies.
"""
