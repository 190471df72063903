"""``benchmarks/suites/plan.py``: reading collectives out of compiled HLO, and the compiled sharded steps against the
analytic traffic of each strategy (tiny preset, 8 H100s, deviceless; ``gpu_compile``).

Buffer sizes per train step for N parameters, a bf16 compute copy (2 bytes each) and the V x D embedding table
(the tiny preset ties it to the LM head), as measured and derived here:
* ``data=8``: one all-reduce of the gradients, about N * 2 bytes (plus float32 scalars: the loss, the norm);
* ``fsdp=8`` with ``remat full``: every layer weight all-gathered in the forward and again in the backward's
  recomputed forward, the embedding table once before the lookup (``jaxattn.model``'s constraint):
  2 * 2 * (N - V*D) + 2 * V*D bytes; the gradients reduce-scattered in bf16 except the table's, which arrives
  in float32 (its lookup's scatter-add): 2 * (N - V*D) + 4 * V*D bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.suites import plan
from jaxattn import gpu_target

# A compiled-HLO excerpt with the forms XLA writes: async combined all-gather / reduce-scatter starts whose
# result is ((inputs...), (outputs...)), a sync reduce-scatter (result = one device's part), an all-reduce, and
# a while body (the layer loop) holding one of them.
HLO = """\
%body.1 (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %all-gather-start.1 = ((bf16[8,64]{1,0}, bf16[8]{0}), (bf16[64,64]{1,0}, bf16[64]{0})) all-gather-start(%a, %b), replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done.1 = (bf16[64,64]{1,0}, bf16[64]{0}) all-gather-done(%all-gather-start.1)
}

ENTRY %main (x: f32[64,256]) -> f32[8,256] {
  %w = (s32[], bf16[8,64]) while(%t), condition=%cond.1, body=%body.1
  %reduce-scatter-start = ((f32[64,256]{1,0}), f32[8,256]{1,0}) reduce-scatter-start(%x), channel_id=1, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}
  %reduce-scatter.2 = bf16[2,16]{1,0} reduce-scatter(%y), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %all-reduce.3 = f32[10]{0} all-reduce(%z), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%add
}
"""


def test_collectives_reads_full_buffer_sizes_and_loop_ops():
    c = plan.collectives(HLO, unknown_trips=16)
    gathered = (64 * 64 + 64) * 2  # the outputs half of the start tuple
    assert c["all-gather"] == {
        "ops": 1,
        "bytes": gathered,
        "ops_in_loop": 1,
        "bytes_in_loop": gathered,
        "bytes_per_step": 16 * gathered,  # no known_trip_count: unknown_trips runs
        "bytes_per_step_in_loops": 16 * gathered,
    }
    # async: the input half (64*256 f32); sync: the part (2*16 bf16) times the group of 4
    assert c["reduce-scatter"]["ops"] == 2 and c["reduce-scatter"]["ops_in_loop"] == 0
    assert c["reduce-scatter"]["bytes"] == 64 * 256 * 4 + 2 * 16 * 2 * 4
    assert c["all-reduce"]["bytes"] == 40
    assert (
        c["all-reduce"]["bytes_per_step"] == 40
        and c["reduce-scatter"]["bytes_per_step"] == c["reduce-scatter"]["bytes"]
    )


# A layer loop of 16 holding a chunk loop of 4 (a scan inside a scan) and a sibling loop of 3, with trip counts.
NESTED = """\
%inner (p: (s32[])) -> (s32[]) {
  %all-reduce.1 = f32[100]{0} all-reduce(%a), replica_groups=[1,8]<=[8], to_apply=%add
}

%outer (p: (s32[])) -> (s32[]) {
  %w.1 = (s32[]) while(%t), condition=%c1, body=%inner, backend_config={"known_trip_count":{"n":"4"}}
  %all-reduce.2 = f32[10]{0} all-reduce(%b), replica_groups=[1,8]<=[8], to_apply=%add
}

%other (p: (s32[])) -> (s32[]) {
  %all-reduce.3 = f32[1]{0} all-reduce(%c), replica_groups=[1,8]<=[8], to_apply=%add
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w.2 = (s32[]) while(%t), condition=%c2, body=%outer, backend_config={"known_trip_count":{"n":"16"}}
  %w.3 = (s32[]) while(%t), condition=%c3, body=%other, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_collectives_counts_each_op_once_per_run_of_its_loops():
    c = plan.collectives(NESTED, unknown_trips=99)  # every loop has a trip count: 99 is never used
    assert c["all-reduce"]["ops"] == 3 and c["all-reduce"]["ops_in_loop"] == 3
    assert c["all-reduce"]["bytes_per_step"] == 16 * 4 * 400 + 16 * 40 + 3 * 4


# The TPU compiler's forms: a layer loop whose collectives sit in fusions (calls=), an async collective fusion whose
# start and done each call a computation holding the same all-gather (one channel id), a reduce-scatter written as a
# fusion calling "all-reduce-scatter" (all-reduce + slice), and an instruction split over two lines.
TPU_HLO = """\
%fused_computation.1 (p: bf16[4,64]) -> (bf16[4,16], bf16[4,64]) {
  %all-gather.1 = bf16[4,64]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=2, replica_groups=mesh['axis_0'=4] {'axis_0'}
}

%fused_computation.2 (p: bf16[4,64]) -> bf16[4,64] {
  %all-gather.2 = bf16[4,64]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=2, replica_groups=mesh['axis_0'=4] {'axis_0'}
}

%all-reduce-scatter.clone.1 (input.1: bf16[8,64]) -> bf16[2,64] {
  %all-reduce.3 = bf16[8,64]{1,0:T(8,128)(2,1)} all-reduce(%input.1), channel_id=5, replica_groups={{0,1,2,3}}, \
to_apply=%add
  ROOT %dynamic-slice.1 = bf16[2,64]{1,0} dynamic-slice(%all-reduce.3, %c, %d), dynamic_slice_sizes={2,64}
}

%body (p: (s32[])) -> (s32[]) {
  %async-collective-start.7 = (bf16[4,16], bf16[4,64]) fusion(%x), kind=kCustom, calls=%fused_computation.1
  %async-collective-done.7 = bf16[4,64] fusion(%y), kind=kCustom, calls=%fused_computation.2
  %fusion.9 = bf16[2,64] fusion(%z), kind=kCustom, calls=%all-reduce-scatter.clone.1, metadata={op_name="a
b"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w.1 = (s32[]) while(%t), condition=%c, body=%body
}
"""


def test_collectives_reads_the_tpu_compilers_forms():
    c = plan.collectives(TPU_HLO, unknown_trips=16)  # the loop has no trip count: 16 runs
    assert c["all-gather"]["ops"] == 1 and c["all-gather"]["ops_in_loop"] == 1  # start and done: one collective
    assert c["all-gather"]["bytes_per_step"] == 16 * 4 * 64 * 2
    assert c["reduce-scatter"]["ops"] == 1 and c["reduce-scatter"]["bytes_per_step"] == 16 * 8 * 64 * 2
    assert c["all-reduce"]["ops"] == 0


# The GPU compiler reuses a channel id in another computation: a pipeline's forward stage loop and its transpose
# (the backward loop) each hold a collective-permute with channel_id=1 — two collectives, told apart by their op.
GPU_PERMUTES = """\
%fwd (p: (s32[])) -> (s32[]) {
  %collective-permute-start.1 = (bf16[1,8]{1,0}, bf16[1,8]{1,0}) collective-permute-start(%a), channel_id=1, \
source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(f)/jvp()/shard_map/while/body/ppermute"}
}

%bwd (p: (s32[])) -> (s32[]) {
  %collective-permute-start = (bf16[1,8]{1,0}, bf16[1,8]{1,0}) collective-permute-start(%b), channel_id=1, \
source_target_pairs={{1,0},{0,1}}, metadata={op_name="jit(f)/transpose(jvp())/shard_map/while/body/ppermute"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w.1 = (s32[]) while(%t), condition=%c, body=%fwd, backend_config={"known_trip_count":{"n":"3"}}
  %w.2 = (s32[]) while(%u), condition=%c, body=%bwd, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_collectives_tells_apart_one_channel_id_in_two_loops():
    c = plan.collectives(GPU_PERMUTES)["collective-permute"]
    assert c["ops"] == 2 and c["bytes_per_step"] == c["bytes_per_step_in_loops"] == 2 * 3 * 16, c


GPU_ALL_TO_ALLS = """HloModule m

%moe (p: f32[4]) -> f32[4] {
  %a = ((bf16[8,16]), (bf16[8,16])) all-to-all-start(%x), channel_id=1, replica_groups=[1,8]<=[8], metadata={op_name="jit(f)/shard_map/all_to_all"}
  %b = ((bf16[8,16]), (bf16[8,16])) all-to-all-start(%y), channel_id=1, replica_groups=[1,8]<=[8], metadata={op_name="jit(f)/shard_map/all_to_all"}
  %c = s32[8,1] all-to-all(%z), channel_id=1, replica_groups=[1,8]<=[8], metadata={op_name="jit(f)/shard_map/all_to_all"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w.1 = (s32[]) while(%t), condition=%c, body=%moe, backend_config={"known_trip_count":{"n":"2"}}
}
"""


def test_collectives_counts_every_op_of_one_computation_and_one_async_buffer():
    """An MoE layer's all-to-alls share one channel id and op name inside one loop body: all three count; an async
    all-to-all's ``((inputs), (outputs))`` counts one buffer."""
    c = plan.collectives(GPU_ALL_TO_ALLS)["all-to-all"]
    assert c["ops"] == 3 and c["bytes_per_step"] == 2 * (2 * 8 * 16 * 2 + 8 * 4), c


def test_committed_moe_plans_exchange_what_the_analysis_says():
    """Every committed expert-parallel row: the compiled all-to-all bytes are the expected padded exchange (layers x
    6 passes x ``[n, T*min(k, E/n), dim]`` bf16) plus the per-expert counts (< 0.1 %); the FSDP rows move none."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h100-plan", "plan.json")
    rows = [r for r in json.load(open(path))["records"] if r.get("preset") in ("mixtral-8x7b", "qwen3-30b-a3b")]
    assert {r["mesh"] for r in rows} >= {"fsdp=8", "expert=8"} and all(r.get("status") == "ok" for r in rows)
    for r in rows:
        moe = r["measured"]["moe"]
        if moe["expert_shards"] == 1:
            assert moe["all_to_all_bytes_compiled"] == 0, r["mesh"]
            continue
        assert moe["all_to_all_bytes_expected"] <= moe["all_to_all_bytes_compiled"], r["mesh"]
        assert moe["all_to_all_bytes_compiled"] <= 1.001 * moe["all_to_all_bytes_expected"], r["mesh"]
        assert moe["all_to_all_bytes_ragged"] < moe["all_to_all_bytes_expected"], r["mesh"]


@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.skipif(gpu_target.unavailable_reason() is not None, reason="deviceless GPU compile unavailable")
def test_a_tiny_moe_plan_compiles_with_its_exchange():
    """moe-tiny (4 experts) over ``expert=4,data=2`` on 8 H100s: the all-to-alls compiled = the expected count."""
    devs = plan._pod_devices("h100", "1x1x8")
    rec = plan.compile_plan(devs, "data=2,expert=4", "moe-tiny", 8, 128)
    moe = rec["measured"]["moe"]
    assert moe["expert_shards"] == 4 and moe["tokens_per_device"] == 128
    assert (
        moe["all_to_all_bytes_expected"] <= moe["all_to_all_bytes_compiled"] <= 1.01 * moe["all_to_all_bytes_expected"]
    )


def test_committed_stage_plans_hand_off_what_the_schedule_says():
    """Every committed pipeline row (``benchmarks/results/h100-plan/plan.json``): the stage loop's permute bytes
    are exactly ``2 x trips x`` a micro-batch's hidden states per device, and its trip count gives the analytic
    idle fraction (GPipe and circular)."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h100-plan", "plan.json")
    rows = [r for r in json.load(open(path))["records"] if "stage=" in r["mesh"] and r.get("status") == "ok"]
    assert {r["schedule"] for r in rows} == {"gpipe", "circular v=2", "gpipe, gather once"} and len(rows) >= 10
    for r in rows:
        pipe = r["measured"]["pipeline"]
        assert pipe["handoff_bytes_compiled"] == pipe["handoff_bytes_expected"], r["mesh"]
        assert pipe["bubble_compiled"] == pytest.approx(pipe["bubble_analytic"]), r["mesh"]


_REASON = gpu_target.unavailable_reason()


@pytest.mark.slow
@pytest.mark.slow_feature
@pytest.mark.gpu_compile
@pytest.mark.skipif(_REASON is not None, reason=f"deviceless GPU compile unavailable: {_REASON}")
def test_compiled_plans_move_what_the_analysis_says():
    import jax
    from flax import nnx

    from benchmarks.tools.deviceless import target_config
    from jaxattn.config import ModelConfig
    from jaxattn.model import Llama

    cfg = ModelConfig.preset("tiny")
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    devs = gpu_target.devices(target_config("h100"), "1x1x8")
    got = {}
    for spec in ("data=8", "fsdp=8"):
        rec = plan.compile_plan(devs, spec, "tiny", 8, 128)
        got[spec] = {k: v["bytes_per_step"] / n for k, v in rec["measured"]["collectives"].items()}
    dp, fsdp = got["data=8"], got["fsdp=8"]
    table = cfg.vocab_size * cfg.dim / n  # the embedding table's share of the parameters
    assert 2.0 <= dp["all-reduce"] <= 2.5 and dp["all-gather"] == dp["reduce-scatter"] == 0, dp
    assert fsdp["reduce-scatter"] == pytest.approx(2 * (1 - table) + 4 * table, rel=0.01), fsdp
    assert fsdp["all-gather"] == pytest.approx(4 * (1 - table) + 2 * table, rel=0.01), fsdp  # + the token ids


@pytest.mark.slow  # a pod compile (8 H100s); test_pipeline checks GPipe's numbers by default, CI runs this one
@pytest.mark.slow_feature
@pytest.mark.gpu_compile
@pytest.mark.skipif(_REASON is not None, reason=f"deviceless GPU compile unavailable: {_REASON}")
def test_a_stage_plan_compiles_with_gpipes_bubble_in_its_loop():
    """A ``stage`` mesh compiles as GPipe for 8 H100s: the layers sharded over the stages (each device holds half of
    them), the stage loop one while loop of ``m + p - 1`` trips, so the idle fraction read off the compiled program
    is GPipe's ``(p - 1) / (m + p - 1)``; stage hand-offs are collective-permutes."""
    devs = plan._pod_devices("h100", "1x1x8")
    rec = plan.compile_plan(devs, "stage=2,data=4", "tiny", 8, 128, microbatches=2)
    pipe = rec["measured"]["pipeline"]
    assert pipe["found"] and pipe["loop_trips"] == 3 and pipe["bubble_compiled"] == pipe["bubble_analytic"] == 1 / 3
    assert rec["measured"]["collectives"]["collective-permute"]["ops"] == 2  # forward hand-off and its transpose
    assert pipe["handoff_bytes_compiled"] == pipe["handoff_bytes_expected"] == 2 * 3 * (4 // 4) * 128 * 64 * 2
    with pytest.raises(ValueError, match="microbatches=2 splits the batch for pipeline stages, but the mesh has no"):
        plan.compile_plan(devs, "data=8", "tiny", 8, 128, microbatches=2)
