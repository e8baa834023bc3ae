"""explain(): the table, the data, and predicted bytes per step equal to the counted bytes."""

import json

import pytest
import torch
from expecttest import assert_expected_inline

from fsdp_compose import explain
from tests.harness import run_on_ranks
from tests.models import lm_loss
from tests.extras.observe.configs import build, counted_bytes, tiny_batch


def _explain_one_d():
    model, loss_of = build("one_d")
    before = explain(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        loss_of(step).backward()
        opt.step()
        opt.zero_grad()
    after = explain(model, opt)
    measured = explain(model, opt, sample_batch=tiny_batch(3), loss_fn=lm_loss).totals
    grads_untouched = all(p.grad is None for p in model.parameters())
    return str(before), str(after), json.dumps(after.to_dict()), after.table(), measured, grads_untouched


def test_explain_table_before_and_after_first_step():
    before, after, data, table, measured, grads_untouched = run_on_ranks(2, _explain_one_d)[0]
    assert_expected_inline(
        before,
        """\
group          params  dtype    sharded  unsharded  all-gather/step  reduce/step     reshard    prefetch fwd / bwd   offload
-------------  ------  -------  -------  ---------  ---------------  --------------  ---------  -------------------  -------
<root> (root)  1,025   float32  2.1 KiB  4.1 KiB    1 x 4.1 KiB      1 x RS 4.2 KiB  no (root)  blocks.0 / blocks.2  -
blocks.0       822     float32  1.7 KiB  3.4 KiB    2 x 6.8 KiB      1 x RS 3.4 KiB  True       blocks.1 / -         -
blocks.1       822     float32  1.7 KiB  3.4 KiB    2 x 6.8 KiB      1 x RS 3.4 KiB  True       blocks.2 / blocks.0  -
blocks.2       822     float32  1.7 KiB  3.4 KiB    2 x 6.8 KiB      1 x RS 3.4 KiB  True       - / blocks.1         -

4 groups, 3,491 parameters (13.6 KiB gathered), shard group 2
per step: 7 all-gathers, 4 reduce-scatters, 0 all-reduces, 38.9 KiB counted; each rank sends 19.5 KiB (3(N-1)/N*P = 20.5 KiB: every parameter gathered twice, reduced once)
predicted peak per rank 46.5 KiB: parameters 7.1 KiB + optimizer state 14.4 KiB (AdamW assumed) + in flight 25.0 KiB (gathered groups, buffers, gradients) at reduce-scatter blocks.2; activations not included
(before the first step: order and prefetch follow module definition order; the first step records the real order)""",
    )
    assert after.startswith(table) and "before the first step" not in after
    data = json.loads(data)
    assert [g["name"] for g in data["groups"]] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert data["totals"]["optimizer_source"] == "measured"
    # sample_batch: one measured forward/backward; activations are what the prediction leaves out
    assert grads_untouched
    assert measured.activation_bytes > 0
    assert measured.predicted_peak_bytes < measured.measured_peak_bytes
    assert measured.measured_peak_bytes <= measured.predicted_peak_bytes + 2 * measured.activation_bytes


def _predicted_vs_counted(config):
    model, loss_of = build(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    predicted_before = explain(model).totals.bytes_per_step
    loss_of(0).backward()  # the first step records the order
    opt.step()
    opt.zero_grad()
    explanation = explain(model, opt)
    start = counted_bytes(model)
    loss_of(1).backward()
    opt.step()
    opt.zero_grad()
    return {
        "predicted": explanation.totals.bytes_per_step,
        "predicted_before_first_step": predicted_before,
        "counted": counted_bytes(model) - start,
        "text": str(explanation),
    }


@pytest.mark.parametrize(
    "config",
    [
        "one_d",
        *(  # 4 ranks each: in the slow run
            pytest.param(config, marks=pytest.mark.slow)
            for config in ("hsdp", "tensor_parallel", "offload", "tied_mixed_precision", "reshard_to_2", "blocks_only")
        ),
    ],
)
def test_every_configuration_predicts_the_bytes_it_moves(config):
    results = run_on_ranks(4, _predicted_vs_counted, config)
    for rank, r in enumerate(results):
        assert r["predicted"] == r["counted"] == r["predicted_before_first_step"], (rank, r)
        assert "(root)" in r["text"], r["text"]
    table = results[0]["text"].split("\n\n")[0]
    if config == "hsdp":
        assert_expected_inline(table, """\
group          params  dtype    sharded  unsharded  all-gather/step  reduce/step                      reshard    prefetch fwd / bwd   offload
-------------  ------  -------  -------  ---------  ---------------  -------------------------------  ---------  -------------------  -------
<root> (root)  1,025   float32  2.1 KiB  4.1 KiB    1 x 4.1 KiB      1 x RS 4.2 KiB + 1 x AR 2.1 KiB  no (root)  blocks.0 / blocks.2  -
blocks.0       822     float32  1.7 KiB  3.4 KiB    2 x 6.8 KiB      1 x RS 3.4 KiB + 1 x AR 1.7 KiB  True       blocks.1 / -         -
blocks.1       822     float32  1.7 KiB  3.4 KiB    2 x 6.8 KiB      1 x RS 3.4 KiB + 1 x AR 1.7 KiB  True       blocks.2 / blocks.0  -
blocks.2       822     float32  1.7 KiB  3.4 KiB    2 x 6.8 KiB      1 x RS 3.4 KiB + 1 x AR 1.7 KiB  True       - / blocks.1         -""")
    elif config == "tied_mixed_precision":
        assert_expected_inline(table, """\
group          params  dtype              sharded  unsharded  all-gather/step  reduce/step     reshard    prefetch fwd / bwd      offload
-------------  ------  -----------------  -------  ---------  ---------------  --------------  ---------  ----------------------  -------
<root> (root)  26      float32->bfloat16  32 B     64 B       1 x 64 B         1 x RS 160 B    no (root)  embed, head / blocks.2  -
embed, head    481     float32->bfloat16  520 B    1.0 KiB    3 x 3.0 KiB      1 x RS 2.0 KiB  True       blocks.0 / -            -
blocks.0       822     float32->bfloat16  960 B    1.9 KiB    2 x 3.8 KiB      1 x RS 3.8 KiB  True       blocks.1 / embed, head  -
blocks.1       822     float32->bfloat16  960 B    1.9 KiB    2 x 3.8 KiB      1 x RS 3.8 KiB  True       blocks.2 / blocks.0     -
blocks.2       822     float32->bfloat16  960 B    1.9 KiB    2 x 3.8 KiB      1 x RS 3.8 KiB  True       - / blocks.1            -""")
    elif config == "reshard_to_2":
        assert_expected_inline(table, """\
group          params  dtype    sharded  unsharded  all-gather/step  reduce/step     reshard  prefetch fwd / bwd   offload
-------------  ------  -------  -------  ---------  ---------------  --------------  -------  -------------------  -------
<root> (root)  1,025   float32  1.1 KiB  4.3 KiB    2 x 8.7 KiB      1 x RS 4.4 KiB  2        blocks.0 / blocks.2  -
blocks.0       822     float32  960 B    3.8 KiB    2 x 7.5 KiB      1 x RS 3.8 KiB  2        blocks.1 / -         -
blocks.1       822     float32  960 B    3.8 KiB    2 x 7.5 KiB      1 x RS 3.8 KiB  2        blocks.2 / blocks.0  -
blocks.2       822     float32  960 B    3.8 KiB    2 x 7.5 KiB      1 x RS 3.8 KiB  2        - / blocks.1         -""")
