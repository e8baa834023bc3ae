"""The fallbacks of _runtime/collectives.py for torch 2.11 and 2.12, run on whatever torch is installed:
their collective names (``_allgather_base`` / ``_reduce_scatter_base``, which torch 2.13 keeps) and a
backward that stashes no context in TLS. CI also runs the whole suite on torch 2.11.0 (tools/test_torch.sh)."""

from collections import Counter

import torch
from torch.distributed import ProcessGroup

from fsdp_compose._runtime import collectives
from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, shard_blocks_then_root, train_against_reference

OLD_NAMES = {"GATHER_METHOD": "_allgather_base", "SCATTER_METHOD": "_reduce_scatter_base"}


def _train_as_on_torch_2_11() -> dict:
    names = {attr: getattr(collectives, attr) for attr in (*OLD_NAMES, "STASHES_CONTEXT")}
    calls: Counter = Counter()
    raw = {name: vars(ProcessGroup)[name] for name in OLD_NAMES.values()}

    def counted(name):
        def call(self, *args):
            calls[name] += 1
            return raw[name](self, *args)

        return call

    for attr, name in OLD_NAMES.items():
        setattr(collectives, attr, name)
        setattr(ProcessGroup, name, counted(name))
    collectives.STASHES_CONTEXT = False
    try:
        result = train_against_reference(TinyLM, shard_blocks_then_root)
    finally:
        for attr, value in names.items():
            setattr(collectives, attr, value)
        for name, fn in raw.items():
            setattr(ProcessGroup, name, fn)
    result["calls"] = dict(calls)
    return result


def test_older_torch_collectives_and_tls_train_at_parity():
    results = run_on_ranks(3, _train_as_on_torch_2_11)
    assert_parity(results)
    for r in results:  # 4 steps of 4 groups: gathered in forward and (resharded) again in backward, one reduction
        assert r["calls"] == {"_allgather_base": 4 * (4 + 3), "_reduce_scatter_base": 4 * 4}, r["calls"]


def test_names_match_the_installed_torch():
    new = hasattr(ProcessGroup, "all_gather_single")
    assert collectives.GATHER_METHOD == ("all_gather_single" if new else "_allgather_base")
    assert collectives.SCATTER_METHOD == ("reduce_scatter_single" if new else "_reduce_scatter_base")
    assert collectives.STASHES_CONTEXT == hasattr(torch._C, "_remove_obj_from_tls")
