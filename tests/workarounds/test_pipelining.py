"""The zero-bubble guard reads a schedule's action table once, not at every step (issue 54, item 6), and
reads it again when the schedule's actions are replaced (``_load_csv`` puts new lists in the table)."""

from types import SimpleNamespace

from fsdp_compose._torch_workarounds.pipelining import _has_weight_pass


class CountedActions(list):
    """A rank's action list that counts how often it is read."""

    reads = 0

    def __iter__(self):
        CountedActions.reads += 1
        return super().__iter__()


def _action(name: str) -> SimpleNamespace:
    return SimpleNamespace(computation_type=SimpleNamespace(name=name))


def test_the_action_table_is_read_once_per_table():
    schedule = SimpleNamespace(pipeline_order={0: CountedActions([_action("FORWARD"), None])})
    CountedActions.reads = 0
    assert [_has_weight_pass(schedule) for _ in range(5)] == [False] * 5
    assert CountedActions.reads == 1
    schedule.pipeline_order[0] = CountedActions([_action("FORWARD"), _action("BACKWARD_WEIGHT")])  # as _load_csv
    assert _has_weight_pass(schedule) and _has_weight_pass(schedule)
    assert CountedActions.reads == 2
    schedule.pipeline_order[1] = CountedActions([_action("FULL_BACKWARD")])  # a rank more
    assert _has_weight_pass(schedule) and CountedActions.reads == 3  # read again (rank 0 holds the pass)
