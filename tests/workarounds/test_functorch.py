"""Issue 51, item 4: a module whose first all-gather happens inside ``torch.func.jvp`` runs, as with torch's
FSDP2: the unsharded parameter is built below the transform (``runtime/functorch.outside_transforms``), and
the primal and tangent outputs equal the unsharded module's."""

import copy

import torch
from torch import nn

from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss


def _jvp_first() -> list[float]:
    from fsdp_compose import fully_shard

    torch.manual_seed(0)
    lin = nn.Linear(8, 6, bias=False)
    model = TinyLM()
    lin_ref, model_ref = copy.deepcopy(lin), copy.deepcopy(model)
    fully_shard(lin)  # the example: its first all-gather inside the transform
    for block in model.blocks:
        fully_shard(block)  # resharded after forward: gathered and freed inside the transform
    fully_shard(model)
    x, t = torch.randn(8), torch.randn(8)
    hidden, tangent = torch.randn(2, 5, 13), torch.randn(2, 5, 13)
    diffs = []
    for sharded, reference, primal, tangent_in in (
        (lin, lin_ref, x, t),
        (model.blocks[0], model_ref.blocks[0], hidden, tangent),  # a block alone: it is its own root here
    ):
        for _ in range(2):  # the first all-gather, then a gather into what the first built
            out, out_tangent = torch.func.jvp(sharded, (primal,), (tangent_in,))
            ref, ref_tangent = torch.func.jvp(reference, (primal,), (tangent_in,))
            diffs += [(out - ref).abs().max().item(), (out_tangent - ref_tangent).abs().max().item()]
    # then the whole model trains as usual
    ids = global_batch(0, 1)
    loss, ref_loss = lm_loss(model, ids), lm_loss(model_ref, ids)
    loss.backward()
    ref_loss.backward()
    diffs.append(abs(loss.item() - ref_loss.item()))
    return diffs


def test_first_all_gather_inside_jvp():
    for diffs in run_on_ranks(2, _jvp_first):
        assert len(diffs) == 9 and max(diffs) <= 1e-5, diffs


def test_transform_switches_found_on_this_torch():
    """``outside_transforms`` uses two private torch switches, looked up once: every supported torch (2.11 to
    2.14.1, CI runs this file on each) has both, so the fallback (the function left as it is, the old
    behaviour) is for a later torch only; without them the decorator must return the function itself."""
    from fsdp_compose._torch_workarounds import functorch

    assert functorch._transforms_active is not None and functorch._DisableTransforms is not None

    def fn():
        return 1

    saved = functorch._transforms_active
    functorch._transforms_active = None
    try:
        assert functorch.outside_transforms(fn) is fn
    finally:
        functorch._transforms_active = saved
    assert functorch.outside_transforms(fn)() == 1
