"""The ledger's message (backends other than gloo): which ranks it names from the exchanged logs.

Its collectives are shown on threaded ranks in ``test_fake_backend.py``; here the naming alone,
for world sizes no test runs: the first rank and those that differ from it, at most eight.
"""

from expecttest import assert_expected_inline

from fsdp_compose.runtime.divergence import ALL_GATHER, REDUCE_SCATTER
from fsdp_compose.runtime.handshake_ledger import _first_difference

SMALL, BIG = (1, ALL_GATHER, 40), (2, ALL_GATHER, 120)


def _describe(uid: int) -> str:
    return f"'block{uid}' (Linear)"


def test_ranks_that_differ_from_the_first_are_named_at_the_first_difference():
    logs = [[SMALL, SMALL]] * 10 + [[SMALL, BIG]] * 2
    logs[5] = [SMALL]  # ran nothing more this round
    assert_expected_inline(
        _first_difference(logs, list(range(100, 112)), _describe),
        """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 100: all-gather of 'block1' (Linear), 40 bytes
  rank 105: no further collective this round
  rank 110: all-gather of 'block2' (Linear), 120 bytes
  rank 111: all-gather of 'block2' (Linear), 120 bytes
  (the first rank and up to 7 that differ from it, of 12)
(on this backend the handshakes are compared on the device and judged when a step's backward ends, so the collectives after the first difference already ran)""",
    )


def test_a_reduce_scatter_brings_the_backward_hint():
    logs = [[SMALL, (1, REDUCE_SCATTER, 64)], [SMALL, BIG]]
    message = _first_difference(logs, [0, 1], _describe)
    assert "rank 0: reduce-scatter of 'block1' (Linear), 64 bytes" in message
    assert "run when a module's backward is done" in message
