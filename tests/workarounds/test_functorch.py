"""A sharded module called inside ``torch.func`` transforms runs as with torch's FSDP2.

Issue 51, item 4: a module whose first all-gather happens inside ``torch.func.jvp``: the unsharded parameter is
built below the transform (``_torch_workarounds/functorch.outside_transforms``), and the primal and tangent
outputs equal the unsharded module's. Issue 54, item 7: a module called inside ``jvp`` on a grad-requiring tensor
made outside the transform (torch's ``test_no_warmup_jvp_reshard_after_forward_false``), and its neighbours (two
such inputs, one beside the primal, ``vmap``, ``torch.func.grad``, a backward of the outer graph afterwards)."""

import copy

import pytest
import torch
import torch.nn.functional as F
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
    """``outside_transforms`` uses two private torch switches, and ``outside_transforms_tensor`` two private
    functions, looked up once: every supported torch (2.11 to 2.14.1, CI runs this file on each) has all four,
    so the fallbacks (the function left as it is, the old behaviour; no output's pre-backward hook moved to the
    outer graph) are for a later torch only."""
    from fsdp_compose._torch_workarounds import functorch

    assert functorch._transforms_active is not None and functorch._DisableTransforms is not None
    assert functorch._is_wrapped is not None and functorch._unwrapped is not None
    assert functorch.transforms_active is functorch._transforms_active

    def fn():
        return 1

    saved = functorch._transforms_active
    functorch._transforms_active = None
    try:
        assert functorch.outside_transforms(fn) is fn
    finally:
        functorch._transforms_active = saved
    assert functorch.outside_transforms(fn)() == 1
    saved = functorch._unwrapped
    functorch._unwrapped = None
    try:
        assert functorch.outside_transforms_tensor(torch.ones(1)) is None  # no output hook moves outside
    finally:
        functorch._unwrapped = saved
    x = torch.ones(1)
    assert functorch.outside_transforms_tensor(x) is x


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _no_warmup_jvp(reshard_after_forward: bool) -> list[float]:
    """torch's ``test_no_warmup_jvp_reshard_after_forward_false`` (test_fully_shard_mixed_precision.py) on gloo,
    checked against the unsharded computation; then an ordinary step, so the jvp left the state usable."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compose import MixedPrecisionPolicy, fully_shard

    dtype = torch.bfloat16
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    with torch.device("meta"):
        enc = nn.Linear(128, 256, bias=False)
        dec = nn.Linear(256, 320, bias=False)
    for module in (enc, dec):
        fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    gen = torch.Generator("cpu")
    for idx, module in enumerate((enc, dec)):
        module.to_empty(device="cpu")
        with torch.no_grad():
            module.weight.normal_(std=module.in_features**-0.5, generator=gen.manual_seed(42 + idx))
    w_enc, w_dec = (_full(m.weight).detach().to(dtype).requires_grad_() for m in (enc, dec))
    x = torch.randn((128,), dtype=dtype, generator=gen.manual_seed(0))
    primal = torch.randn((320,), dtype=dtype, generator=gen.manual_seed(1), requires_grad=True)
    tangent = torch.randn((320,), dtype=dtype, generator=gen.manual_seed(2))
    e = enc(x)  # outside the transform, requires grad: inside it, its view has neither requires_grad nor a node

    def fn(unused: torch.Tensor) -> torch.Tensor:
        return dec(e)

    output, tangent_output = torch.func.jvp(fn, (primal,), (tangent,))
    assert output.shape == (320,) and output.dtype == dtype
    assert torch.equal(tangent_output, torch.zeros_like(output))  # what torch's test asserts
    ref = F.linear(F.linear(x, w_enc), w_dec)
    diffs = [(output - ref).abs().max().item()]
    # an ordinary step afterwards (both ranks see the same input, so the averaged gradient is the reference's)
    dec(enc(x)).float().sum().backward()
    F.linear(F.linear(x, w_enc), w_dec).float().sum().backward()
    for module, w in ((enc, w_enc), (dec, w_dec)):
        diffs.append(((_full(module.weight.grad) - w.grad.float()).abs().max() / w.grad.float().abs().max()).item())
    return diffs


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_no_warmup_jvp_on_an_input_made_outside(reshard_after_forward):
    for diffs in run_on_ranks(2, _no_warmup_jvp, reshard_after_forward):
        assert diffs[0] == 0.0 and max(diffs[1:]) <= 1e-2, diffs


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6, bias=False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) * self.lin(b)


def _neighbours(reshard_after_forward: bool) -> dict[str, float]:
    """Each case on the sharded modules and on unsharded copies: the largest difference of what it returns and
    of the gradients a backward of the outer graph accumulates afterwards."""
    from fsdp_compose import fully_shard

    torch.manual_seed(0)
    enc, dec, two = nn.Linear(4, 8, bias=False), nn.Linear(8, 6, bias=False), _Two()
    ref_modules = copy.deepcopy((enc, dec, two))
    for module in (enc, dec, two):
        fully_shard(module, reshard_after_forward=reshard_after_forward)
    x, p, t, batch = torch.randn(4), torch.randn(8, requires_grad=True), torch.randn(8), torch.randn(3, 8)
    cases = {  # (enc, dec, two), e = enc(x) -> tensors compared; each ends with a backward of the outer graph
        "jvp, an input made outside": lambda m, e: torch.func.jvp(lambda _: m[1](e), (p,), (t,)),
        "jvp, two inputs made outside": lambda m, e: torch.func.jvp(lambda _: m[2](e, e * 2), (p,), (t,)),
        "jvp, one made outside beside the primal": lambda m, e: torch.func.jvp(lambda q: m[2](e, q), (p,), (t,)),
        "vmap, an input made outside": lambda m, e: (torch.func.vmap(lambda b: m[2](e, b))(batch),),
        "torch.func.grad": lambda m, e: (torch.func.grad(lambda q: m[2](e.detach(), q).sum())(p.detach()), e),
    }
    diffs = {}
    for name, case in cases.items():
        got = []
        for modules in (ref_modules, (enc, dec, two)):
            for m in modules:
                m.zero_grad()
            outputs = case(modules, modules[0](x))
            outputs[0].sum().backward() if outputs[0].requires_grad else outputs[-1].sum().backward()
            grads = [m.weight.grad for m in (modules[0], modules[1], modules[2].lin)]
            got.append([*outputs, *(torch.zeros(()) if g is None else _full(g) for g in grads)])
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(*got))
    return diffs


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_neighbouring_transform_calls_match_the_unsharded_modules(reshard_after_forward):
    for diffs in run_on_ranks(2, _neighbours, reshard_after_forward):
        assert max(diffs.values()) <= 1e-6, diffs
