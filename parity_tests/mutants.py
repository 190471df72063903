"""The mutation check: plant realistic bugs in package code one at a time and see whether the default run catches them.

    python -m parity_tests.mutants                       # every mutant; a table of caught / missed with seconds
    python -m parity_tests.mutants --area moe --jobs 2   # one area, two mutants at a time
    python -m parity_tests.mutants --check               # every planted edit still applies (no test is run)

Each :class:`Mutant` is a bug as it would be written (a denominator, an index, an order, a direction), given as exact
text edits of package files (each ``old`` must occur exactly once, so a mutant that no longer fits the code is an
error, never a silent pass) and the tests that should catch it, run as CI runs them: ``-m "not slow"`` (and no
``gpu``). The edits go into a temporary copy of the repository (``git ls-files``; the checkout is never touched);
pytest runs there with ``-x`` and the copy first on ``PYTHONPATH`` (child processes, torchrun and the CLIs included,
import the copy too); the edit is undone before the next mutant. ``caught``: the tests failed; ``missed``: they
passed; ``error``: they could not run (no test selected, a collection error, a timeout). ``--baseline`` first runs
each distinct selection unmutated: a selection that fails there makes its mutants ``invalid``. Exit 0 when every
mutant is caught, 1 otherwise, 2 on bad arguments. Written by hand: mutmut and cosmic-ray generate operator swaps
at random, while a planted bug here is a named, realistic one with the tests that should catch it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELECT = "not slow and not gpu"  # what CI's default run selects (gpu tests skip on a CPU anyway)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    edits: tuple[tuple[str, str, str], ...]  # (path from the repository root, old text, new text), applied in order
    tests: str  # pytest arguments: files, node ids, -k
    why: str  # the bug in words


def m(name: str, area: str, path: str, old: str, new: str, tests: str, why: str) -> Mutant:
    return Mutant(name, area, ((path, old, new),), tests, why)


_FCE = "parity_tests/test_fused_ce.py -k 'equals_dense or 1e4 or twenty_steps'"
_FLASH = "parity_tests/test_flash.py -k 'TestFlashInterpret or backward'"
_STATS = "parity_tests/test_profiling.py -k 'ratio or median_ci or interleaved or pooled'"

MUTANTS: tuple[Mutant, ...] = (
    # ---- Mixture of Experts
    m(
        "moe-renorm-jax",
        "moe",
        "jaxattn/moe.py",
        "weights = weights / jnp.sum(weights, axis=-1, keepdims=True)",
        "weights = weights / jnp.sum(probs, axis=-1, keepdims=True)",
        "parity_tests/test_moe.py -k 'transformers or torch_vs_jax'",
        "the top-k weights renormalised by the sum over all experts (a no-op) instead of the chosen k",
    ),
    m(
        "moe-renorm-torch",
        "moe",
        "torchref/moe.py",
        "weights = weights / weights.sum(dim=-1, keepdim=True)",
        "weights = weights / probs.sum(dim=-1, keepdim=True)",
        "parity_tests/test_moe.py -k 'transformers or torch_vs_jax'",
        "the torch twin's renormalisation over all experts",
    ),
    m(
        "moe-capacity-rule",
        "moe",
        "twincore/config.py",
        "math.ceil(self.capacity_factor * tokens * self.experts_per_token / self.n_experts)",
        "math.ceil(self.capacity_factor * tokens / self.n_experts)",
        "parity_tests/test_moe.py -k 'capacity or float64'",
        "GShard's capacity without the k assignments per token",
    ),
    m(
        "moe-capacity-keep",
        "moe",
        "jaxattn/moe.py",
        "keep = pos < capacity",
        "keep = pos <= capacity",
        "parity_tests/test_moe.py -k 'capacity or float64'",
        "one assignment past the capacity kept (an off-by-one in the queue test)",
    ),
    m(
        "moe-group-offsets",
        "moe",
        "jaxattn/moe.py",
        "dest = (jnp.cumsum(sizes) - sizes)[keys] + rank",
        "dest = jnp.cumsum(sizes)[keys] + rank",
        "parity_tests/test_moe.py -k 'float64 or empty_experts'",
        "an inclusive instead of an exclusive prefix sum for each expert's first row",
    ),
    m(
        "moe-grouped-mm-offsets",
        "moe",
        "torchref/moe.py",
        "offs=torch.cumsum(sizes, 0, dtype=torch.int32)",
        "offs=(torch.cumsum(sizes, 0) - sizes).to(torch.int32)",
        "parity_tests/test_moe.py -k 'grouped_mm or float64'",
        "torch._grouped_mm given group starts instead of group ends",
    ),
    m(
        "moe-grouped-gemm-tiles",
        "moe",
        "jaxattn/grouped_matmul.py",
        "counts = jnp.where(ends > starts, cdiv(ends, bm) - first, 0)",
        "counts = jnp.where(ends > starts, ends // bm - first, 0)",
        "parity_tests/test_grouped_matmul.py -k 'float64 or tile_schedule or degenerate'",
        "a group's last partial row tile left out of the tile schedule (floor for ceil)",
    ),
    m(
        "moe-ep-counts-jax",
        "moe",
        "jaxattn/moe.py",
        "counts = jax.lax.all_to_all(per_rank, axis, 0, 0)",
        "counts = per_rank",
        "parity_tests/test_moe_train.py -k jax_expert_parallel_equals_one_device",
        "the JAX expert-parallel exchange uses its own send counts for what it received",
    ),
    m(
        "moe-ep-order-torch",
        "moe",
        "torchref/moe.py",
        "local = got.transpose(0, 1).reshape(e // n, n * b * c, d)",
        "local = got.reshape(e // n, n * b * c, d)",
        "parity_tests/test_moe_train.py -k 'torchrun_expert_parallel and capacity'",
        "the torch expert-parallel exchange reads the received buffers source-major",
    ),
    m(
        "moe-ep-regroup-torch",
        "moe",
        "torchref/moe.py",
        "order = torch.sort(local, stable=True).indices  # by local expert, then source",
        "order = torch.arange(local.numel())  # by local expert, then source",
        "parity_tests/test_moe_train.py -k 'torchrun_expert_parallel and not capacity'",
        "the dropless torch exchange leaves received rows in source order, not grouped by local expert",
    ),
    Mutant(
        "moe-mixtral-w1-w3",
        "moe",
        (
            (
                "twincore/params.py",
                '"blk.{i}.ffn_gate_exps.weight",\n        present=_moe,\n        hf_alt=(("mixtral", '
                '"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"),),',
                '"blk.{i}.ffn_gate_exps.weight",\n        present=_moe,\n        hf_alt=(("mixtral", '
                '"model.layers.{i}.block_sparse_moe.experts.{e}.SWAP.weight"),),',
            ),
            (
                "twincore/params.py",
                '"model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"',
                '"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"',
            ),
            (
                "twincore/params.py",
                '"model.layers.{i}.block_sparse_moe.experts.{e}.SWAP.weight"',
                '"model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"',
            ),
        ),
        "parity_tests/test_moe.py -k 'transformers or hf_names'",
        "Mixtral's gate (w1) and up (w3) projections swapped in the name table",
    ),
    # ---- pipeline stages
    m(
        "pipe-loss-denominator-torch",
        "pipeline",
        "torchref/pipeline.py",
        "loss = nll / self._denominator\n",
        "loss = nll / max(float((targets != -100).sum()), 1.0)\n",
        "parity_tests/test_pipeline.py -k token_weighted_mean",
        "each micro-batch's loss its own mean (the batch loss a mean of means)",
    ),
    m(
        "pipe-round-robin-torch",
        "pipeline",
        "torchref/pipeline.py",
        "return [rank + k * ranks for k in range(per_rank)]",
        "return [rank * per_rank + k for k in range(per_rank)]",
        "parity_tests/test_pipeline.py -k round_robin",
        "interleaved stages assigned contiguously instead of round-robin over the ranks",
    ),
    m(
        "pipe-stage-item-jax",
        "pipeline",
        "jaxattn/pipeline.py",
        "y, st = run(h, i // m, jax.tree.map(lambda a: a[i % m], sm))",
        "y, st = run(h, i // m, jax.tree.map(lambda a: a[t % m], sm))",
        "parity_tests/test_pipeline.py -k 'remat_and_segment_ids or circular or gpipe_equals'",
        "a stage takes the segment ids / RoPE tables of the clock's micro-batch, not of the one it holds",
    ),
    m(
        "pipe-ppermute-direction-jax",
        "pipeline",
        "jaxattn/pipeline.py",
        "[(a, (a + 1) % p) for a in range(p)]",
        "[(a, (a - 1) % p) for a in range(p)]",
        "parity_tests/test_pipeline.py -k 'gpipe_equals or passes_activations'",
        "activations passed to the previous stage instead of the next",
    ),
    m(
        "pipe-stage-layers-torch",
        "pipeline",
        "torchref/pipeline.py",
        "return range(index * per, (index + 1) * per)",
        "return range(index * per, (index + 1) * per - 1)",
        "parity_tests/test_pipeline.py -k 'token_weighted_mean or round_robin or parallel_pp_trains'",
        "each stage's last decoder layer left out of its split",
    ),
    # ---- fused linear + cross-entropy
    m(
        "fce-lse-no-max-jax",
        "fused loss",
        "jaxattn/fused_ce.py",
        "return m, jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))",
        "return jnp.zeros_like(m), jnp.log(jnp.sum(jnp.exp(logits), axis=-1))",
        _FCE,
        "the log-sum-exp without the max subtraction (inf for logits around 100)",
    ),
    m(
        "fce-lse-no-max-torch",
        "fused loss",
        "torchref/fused_ce.py",
        "m = logits.amax(dim=-1)  # [chunk]",
        "m = torch.zeros_like(logits[:, 0])  # [chunk]",
        _FCE,
        "the torch twin's log-sum-exp without the max subtraction",
    ),
    m(
        "fce-last-chunk-torch",
        "fused loss",
        "torchref/fused_ce.py",
        "for s in range(0, hidden.shape[0], chunk):",
        "for s in range(0, hidden.shape[0] - chunk + 1, chunk):",
        _FCE,
        "the last, partial chunk of tokens left out of the forward",
    ),
    m(
        "fce-backward-softmax-jax",
        "fused loss",
        "jaxattn/fused_ce.py",
        "probs = jnp.exp((logits - m[:, None]) - log_sum[:, None])",
        "probs = jnp.exp(logits - m[:, None])",
        _FCE,
        "the backward's softmax not divided by its sum",
    ),
    # ---- attention backends
    m(
        "flash-rescale",
        "attention",
        "jaxattn/attention/flash.py",
        "acc = acc * alpha[:, None] + dot(p.astype(pv_dtype), v, 1, 0)",
        "acc = acc + dot(p.astype(pv_dtype), v, 1, 0)",
        _FLASH,
        "the online softmax's accumulator not rescaled when the running max moves (FlashAttention-2 alg. 1)",
    ),
    m(
        "flash-lse-units",
        "attention",
        "jaxattn/attention/flash.py",
        "lse_ref[...] = jnp.where(seen, m * LN2 + jnp.log(l_safe), -jnp.inf)",
        "lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)",
        _FLASH,
        "the saved log-sum-exp mixes log2 (the running max) and natural-log units",
    ),
    m(
        "flash-delta-sign",
        "attention",
        "jaxattn/attention/flash.py",
        "delta = delta - dlse.astype(jnp.float32)",
        "delta = delta + dlse.astype(jnp.float32)",
        "parity_tests/test_flash.py parity_tests/test_attention.py -k 'lse or backward'",
        "the cotangent of the log-sum-exp folded into delta with the wrong sign",
    ),
    m(
        "mosaic-bwd-delta",
        "attention",
        "jaxattn/attention/mosaic.py",
        "dst = pt * (dpt - ops.col(delta_ring.at[slot], (bkv, bq)))",
        "dst = pt * dpt",
        "parity_tests/test_mosaic.py -k 'interpreted_backward or emulated'",
        "the Mosaic dkv kernel forgets delta = rowsum(dO * O) in dS = P * (dP - delta) (FlashAttention-2 alg. 2)",
    ),
    m(
        "mosaic-overlap-mask-from",
        "attention",
        "jaxattn/attention/mosaic.py",
        "return lax.cond(t >= full, lambda x:",
        "return lax.cond(t > full, lambda x:",
        "parity_tests/test_mosaic.py -k 'race_free and overlap'",
        "the overlap forward leaves its first partly masked key block unmasked (an off-by-one at the mask's start)",
    ),
    m(
        "mosaic-overlap-rescale-skipped",
        "attention",
        "jaxattn/attention/mosaic.py",
        "                acc = _rescale(acc, alpha)\n                end_window()",
        "                end_window()",
        "parity_tests/test_mosaic.py -k 'race_free and overlap'",
        "the overlap forward adds P V of block t - 1 but never rescales the accumulator by the new running max",
    ),
    m(
        "mosaic-bwd-first-query-block",
        "attention",
        "jaxattn/attention/mosaic.py",
        "lo = jnp.minimum(lax.div(jnp.maximum(k_base - offset, 0), jnp.asarray(block_q, jnp.int32)), nq)",
        "lo = jnp.minimum(lax.div(jnp.maximum(k_base - offset + 1, 0), jnp.asarray(block_q, jnp.int32)), nq)",
        "parity_tests/test_mosaic.py -k 'query_bounds or interpreted_backward'",
        "the dkv kernel's first query block off by one row: a block whose last row sees the first key is skipped",
    ),
    m(
        "decode-merge-base",
        "attention",
        "jaxattn/attention/decode.py",
        "w = jnp.exp2(m - m_max)",
        "w = jnp.exp(m - m_max)",
        "parity_tests/test_flash_decode.py -k 'TestFlashDecodeInterpret or few_query'",
        "split-K partials merged with base-e weights while their maxima are in log2 units",
    ),
    m(
        "splash-causal-offset",
        "attention",
        "jaxattn/attention/splash.py",
        "one = sa.CausalMask(shape, offset=offset)",
        "one = sa.CausalMask(shape, offset=0)",
        "parity_tests/test_splash.py -k oracle",
        "splash's causal mask top-left instead of bottom-right when q_len != kv_len",
    ),
    m(
        "splash-kv-chunk-offset",
        "attention",
        "jaxattn/attention/splash.py",
        "pos = c * KV_CHUNK + jnp.arange(KV_CHUNK, dtype=jnp.int32)",
        "pos = jnp.arange(KV_CHUNK, dtype=jnp.int32)",
        "parity_tests/test_splash.py -k 'across_kv_chunks or oracle'",
        "the scan for queries without a key drops each key chunk's offset",
    ),
    Mutant(
        "softcap-order-torch",
        "attention",
        (
            (
                "torchref/attention.py",
                "qf, k.float()) * scale\n    if softcap is not None:\n        s = softcap * torch.tanh(s / softcap)",
                "qf, k.float())\n    if softcap is not None:\n        s = softcap * torch.tanh(s / softcap) * scale",
            ),
        ),
        "parity_tests/test_attention.py -k 'fp32_parity and not sweep'",
        "the softcap applied before the scale (tanh of unscaled scores)",
    ),
    m(
        "torch-causal-offset",
        "attention",
        "torchref/attention.py",
        "i_abs = torch.arange(sq, device=device)[:, None] + (sk - sq)",
        "i_abs = torch.arange(sq, device=device)[:, None]",
        "parity_tests/test_attention.py -k 'fp32_parity and not sweep'",
        "torch's causal mask top-left instead of bottom-right when q_len != kv_len",
    ),
    m(
        "chunked-softcap-scale",
        "attention",
        "jaxattn/attention/chunked.py",
        "t = jnp.tanh(s / cfg.softcap)",
        "t = jnp.tanh(s)",
        "parity_tests/test_attention.py -k 'fp32_parity and not sweep'",
        "the chunked kernel's softcap without the division by the cap",
    ),
    # ---- the porting debugger
    m(
        "diff-tolerance",
        "debugger",
        "parity_tests/diff.py",
        '"ok": bool(ratio <= tolerance),',
        '"ok": bool(ratio <= tolerance * 100),',
        "parity_tests/test_diff.py -k 'compare_marks or planted or low_precision'",
        "the tolerance scaled so a real bug's error passes as rounding",
    ),
    m(
        "diff-worse-twin",
        "debugger",
        "parity_tests/diff.py",
        '"worse": "torch" if err_t > err_j else "jax",',
        '"worse": "torch" if err_t < err_j else "jax",',
        "parity_tests/test_diff.py -k 'compare_marks or planted or low_precision'",
        "the debugger blames the wrong twin",
    ),
    # ---- benchmark statistics
    m(
        "stats-paired-swapped",
        "statistics",
        "benchmarks/measure.py",
        'paired = paired_ratio(t["torch"]["rounds"], t["jax"]["rounds"]',
        'paired = paired_ratio(t["jax"]["rounds"], t["torch"]["rounds"]',
        "parity_tests/test_benchmarks.py -k timeit_paired",
        "the reported JAX speed-up inverted (numerator and denominator swapped)",
    ),
    m(
        "stats-block-pair-swapped",
        "statistics",
        "benchmarks/tools/block_search.py",
        'paired_ratio(t["default"]["rounds"], t["best"]["rounds"]',
        'paired_ratio(t["best"]["rounds"], t["default"]["rounds"]',
        "parity_tests/test_gpu_session.py -k block_search_times",
        "the block search's speed-up of its winner over the default inverted",
    ),
    m(
        "tokamax-argv-flags",
        "records",
        "benchmarks/tools/programs.py",
        "        flags.FLAGS.mark_as_parsed()\n    return tokamax",
        "        pass\n    return tokamax",
        "parity_tests/test_benchmarks.py -k tokamax_peer",
        "tokamax parses our command line (`run --quick`) as its absl flags and every tokamax row is skipped",
    ),
    m(
        "stats-order-tie-ignored",
        "statistics",
        "benchmarks/tools/default_order.py",
        "if med[b] <= med[a] * TIE and place.get(b, len(current)) < place.get(a, len(current)):",
        "if med[b] < med[a] and place.get(b, len(current)) < place.get(a, len(current)):",
        "parity_tests/test_gpu_session.py -k default_order",
        "the default attention order moved by a 2% lead inside the tie band",
    ),
    m(
        "profile-xla-ops-counted",
        "statistics",
        "benchmarks/tools/kernel_profile.py",
        'if line.name.startswith("Stream"):',
        'if not line.name.startswith("/host"):',
        "parity_tests/test_kernel_profile.py",
        "the device-time reader also sums the GPU plane's 'XLA Ops' line, counting each kernel twice",
    ),
    m(
        "profile-busy-overlap-twice",
        "statistics",
        "benchmarks/tools/kernel_profile.py",
        "busy += max(0.0, k1 - max(k0, end))",
        "busy += k1 - k0",
        "parity_tests/test_kernel_profile.py -k call_timeline",
        "a call's device busy time sums its kernels' durations: two overlapping kernels count twice",
    ),
    m(
        "profile-kernel-to-first-span",
        "statistics",
        "benchmarks/tools/kernel_profile.py",
        "if s0 <= k0 and k1 <= s1), None)",
        "if s0 <= k0), None)",
        "parity_tests/test_kernel_profile.py -k call_timeline",
        "each kernel placed in the first call that started before it, not the call whose span holds it",
    ),
    m(
        "profile-torch-annotation-as-kernel",
        "statistics",
        "benchmarks/tools/kernel_profile.py",
        'getattr(ev, "is_user_annotation", False) or ev.name == SPAN',
        "False",
        "parity_tests/test_kernel_profile.py -k torch_reader",
        "kineto's GPU copy of the call's record_function range is summed as a kernel (torch's device time doubled)",
    ),
    m(
        "flash-dkv-default-launch-dropped",
        "attention",
        "jaxattn/attention/flash.py",
        "num_warps_dkv=warps_dkv,\n            num_stages_dkv=stages_dkv,",
        "",
        "parity_tests/test_flash.py -k dkv_launch",
        "BlockSizes.default drops the dkv kernel's own launch: the timed D=128 default runs with dq's 2 stages",
    ),
    m(
        "block-search-gqa-merged-with-mha",
        "statistics",
        "benchmarks/tools/block_search.py",
        'return (row["kernel"], row["head_dim"], row["dtype"], row.get("kv_heads", AttnShape().hkv))',
        'return (row["kernel"], row["head_dim"], row["dtype"], AttnShape().hkv)',
        "parity_tests/test_gpu_session.py -k gqa_group",
        "a GQA block search's rows take the MHA group's key: writing them erases the 16/16-head search",
    ),
    m(
        "ptxas-serialized-wgmma-ignored",
        "statistics",
        "benchmarks/tools/kernel_stats.py",
        'out.setdefault(m.group(2), {})["wgmma_serialized"] = m.group(1)',
        "pass",
        "parity_tests/test_gpu_compile.py -k 'ptxas_report or wgmma_stays'",
        "ptxas's C7513 (every wgmma serialized) dropped from the kernel records: the filter passes a serialized kernel",
    ),
    m(
        "measure-sync-every-framework",
        "statistics",
        "benchmarks/measure.py",
        "(not jax_out or any(isinstance(x, torch.Tensor) for x in leaves))",
        "True",
        "parity_tests/test_benchmarks.py -k sync_waits",
        "the suites' wait runs torch.cuda.synchronize after a jax result too: one more host round trip per JAX row",
    ),
    m(
        "stats-pooled-interval",
        "statistics",
        "twincore/timing.py",
        "lo, hi = percentile(medians, tail), percentile(medians, 1.0 - tail)",
        "lo, hi = median_ci([x for p in procs for x in p], confidence)[:2]",
        _STATS,
        "the pooled interval from the raw rounds instead of the hierarchical bootstrap",
    ),
    m(
        "stats-median-ci-index",
        "statistics",
        "twincore/timing.py",
        "return xs[k - 1], xs[n - k], coverage(k)",
        "return xs[k], xs[n - k - 1], coverage(k)",
        _STATS,
        "the order-statistic interval one rank too narrow",
    ),
    m(
        "stats-no-alternation",
        "statistics",
        "twincore/timing.py",
        "for name in names if r % 2 == 0 else names[::-1]:",
        "for name in names:",
        _STATS,
        "the interleaved rounds always in the same order (a warm-up or drift bias on one side)",
    ),
    m(
        "stats-unstable-width",
        "statistics",
        "twincore/timing.py",
        "if hi / lo > UNSTABLE_CI:",
        "if hi - lo > UNSTABLE_CI:",
        _STATS,
        "an interval's width compared as a difference, not a factor (wide ratios never unstable)",
    ),
    # ---- deviceless kernel records
    m(
        "records-smem-compile-order",
        "records",
        "benchmarks/tools/kernel_stats.py",
        "size = smem[lowering.index(name)] if len(smem) == len(modules) else None",
        "size = smem[list(names).index(name)] if len(smem) == len(modules) else None",
        "parity_tests/test_gpu_compile.py -k name_each_kernel",
        "a Mosaic kernel's shared memory taken in compile order, where Mosaic reports it in lowering order",
    ),
    m(
        "records-ptx-cut-at-function",
        "records",
        "benchmarks/tools/kernel_stats.py",
        "ends = [m.end() for m in _PTX_BLOCK_END.finditer(part)]",
        'ends = [part.rfind("\\n}") + 2] if "\\n}" in part else []',
        "parity_tests/test_gpu_compile.py -k 'split_ptx or sass_counts_where'",
        "a Mosaic module cut at its last function, dropping the debug sections its .loc lines cite (no SASS counts)",
    ),
    m(
        "records-mosaic-cache-unsalted",
        "records",
        "benchmarks/tools/kernel_stats.py",
        "salt = os.urandom(16)",
        'salt = b""',
        "parity_tests/test_gpu_compile.py -k compiled_twice",
        "Mosaic's per-process kernel cache hit again: a kernel compiled twice prints no PTX the second time",
    ),
    # ---- training: accumulation, loss scaling, optimizers
    m(
        "accum-denominator-jax",
        "training",
        "jaxattn/train_step.py",
        "grads, loss = grad_fn(params, mb, denominator)",
        "grads, loss = grad_fn(params, mb, loss_denominator(mb))",
        "parity_tests/test_grad_accum.py",
        "each micro-batch's loss its own mean, then summed (k times the gradient, per-micro-batch weighting)",
    ),
    m(
        "accum-slice-torch",
        "training",
        "torchref/train_step.py",
        "mb = {k: v if v is None else v[i * micro : (i + 1) * micro] for k, v in batch.items()}",
        "mb = {k: v if v is None else v[i * micro : (i + 1) * micro + 1] for k, v in batch.items()}",
        "parity_tests/test_grad_accum.py",
        "micro-batches overlapping by one row",
    ),
    m(
        "loss-scale-tracker",
        "training",
        "jaxattn/loss_scale.py",
        "new_tracker = jnp.where(finite, jnp.where(grow, 0, successful), 0).astype(jnp.int32)",
        "new_tracker = jnp.where(finite, jnp.where(grow, 0, successful), tracker).astype(jnp.int32)",
        "parity_tests/test_loss_scale.py",
        "the growth counter not reset by an overflow (GradScaler resets it)",
    ),
    m(
        "adafactor-eps-jax",
        "training",
        "jaxattn/optim.py",
        "jnp.maximum(var, eps * eps)",
        "var + 1e-30",
        "parity_tests/test_optim.py -k adafactor",
        "JAX's Adafactor adds optax's 1e-30 to V: a gradient element below float32's eps moves by sign(g), not g / eps",
    ),
    m(
        "adafactor-row-mean-jax",
        "training",
        "jaxattn/optim.py",
        "jnp.maximum(v_row.mean(-1), eps)",
        "v_row.mean(-1)",
        "parity_tests/test_optim.py -k adafactor",
        "JAX's Adafactor without torch's clamp of the mean row variance (optax's variant): a matrix with small "
        "gradients steps ~27x too far",
    ),
    m(
        "adafactor-clip-per-stack-jax",
        "training",
        "jaxattn/optim.py",
        "u = u / jnp.maximum(1.0, _rms(u, b) / clipping_threshold)",
        "u = u / jnp.maximum(1.0, _rms(u, 0) / clipping_threshold)",
        "parity_tests/test_optim.py -k adafactor",
        "JAX's Adafactor clips RMS(U) over a whole stack of layers, where torch clips each layer's param",
    ),
    m(
        "optim-unstacked-jax",
        "training",
        "jaxattn/optim.py",
        'int(param_name(path).startswith("layers."))',
        "0",
        "parity_tests/test_optim.py",
        "the optimizers treat a stacked layers leaf as one param (8-bit sizes and blocks, Adafactor factoring and "
        "RMS over all layers at once; torch has one param per layer)",
    ),
    m(
        "checkpoint-empty-leaves-jax",
        "training",
        "jaxattn/checkpoint.py",
        "return jax.tree.map(lambda x: None if _is_empty(x) else x, tree)",
        "return tree",
        "parity_tests/test_checkpoint.py -k every_optimizer",
        "the JAX checkpointer hands orbax the optimizer state's zero-size arrays (adamw8bit / adafactor runs "
        "cannot save)",
    ),
    m(
        "adamw8bit-bias-correction",
        "training",
        "torchref/optim.py",
        "u = m / (v.sqrt() / math.sqrt(1.0 - b2**t) + eps) / (1.0 - b1**t)",
        "u = m / (v.sqrt() / math.sqrt(1.0 - b2**t) + eps) / (1.0 - b1)",
        "parity_tests/test_optim.py -k 'adamw8bit or bitsandbytes'",
        "the first moment's bias correction without the step power",
    ),
    # ---- data, data parallelism, remat
    m(
        "data-positions-restart",
        "data",
        "twincore/data.py",
        '"positions": np.where(pad, 0, idx - last_start).astype(np.int32),',
        '"positions": np.where(pad, 0, idx).astype(np.int32),',
        "parity_tests/test_data.py",
        "packed rows' RoPE positions count on across document boundaries instead of restarting",
    ),
    m(
        "ddp-row-block",
        "data",
        "torchref/parallel.py",
        "v.reshape(blocks, n, m, *v.shape[1:])[:, rank]",
        "v.reshape(blocks, n, m, *v.shape[1:])[:, 0]",
        "parity_tests/test_parallel.py -k 'parallel_mode_matches_one_process'",
        "every data-parallel rank takes the first rank's rows (the rank index dropped)",
    ),
    m(
        "remat-save-dots",
        "training",
        "jaxattn/remat.py",
        '"save_dots": _cp.dots_with_no_batch_dims_saveable,',
        '"save_dots": _cp.everything_saveable,',
        "parity_tests/test_remat.py -k policies_change",
        "the save_dots policy mapped to jax's everything_saveable (no memory saved, no error)",
    ),
    m(
        "resume-position",
        "training",
        "twincore/trainer.py",
        'self.start = self.last_saved = int(meta["data_position"])',
        'self.start = self.last_saved = int(meta["data_position"]) + 1',
        "parity_tests/test_checkpoint.py -k sigkill",
        "a resumed run (either twin: the shared Trainer) starts one batch past the one the checkpoint had reached",
    ),
    m(
        "resume-applied-jax",
        "training",
        "jaxattn/train.py",
        'self.applied = int(meta["applied_updates"])',
        "self.applied = 0",
        "parity_tests/test_checkpoint.py -k 'sigkill and jaxattn'",
        "a resumed JAX run forgets the updates already applied, so its learning-rate schedule restarts",
    ),
    # ---- model, cache, generation, int8
    m(
        "rope-rotate-half",
        "model",
        "jaxattn/model.py",
        "rotated = jnp.concatenate([-x2, x1], axis=-1)",
        "rotated = jnp.concatenate([x2, -x1], axis=-1)",
        "parity_tests/test_model.py -k 'rope or full_model'",
        "rotate_half's sign on the wrong half (RoPE rotating the other way)",
    ),
    m(
        "kv-cache-positions",
        "model",
        "jaxattn/kv_cache.py",
        "return self.lengths[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]",
        "return jnp.zeros_like(self.lengths)[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'cache_decode or ragged'",
        "decode steps' RoPE positions restart at 0 instead of following the cache",
    ),
    m(
        "kv-cache-decode-mask-torch",
        "model",
        "torchref/kv_cache.py",
        "                visible = slots <= last\n",
        "                visible = slots < last\n",
        "parity_tests/test_kv_cache.py -k 'cache_decode or mask_once'",
        "the decode step's mask hides the slot it is writing (the new token does not see itself)",
    ),
    m(
        "prefill-last-token-torch",
        "model",
        "torchref/generate.py",
        "logits = model(tokens, cache=full, logits_at=(lengths - 1)[:, None])  # [B, 1, vocab]",
        "logits = model(tokens, cache=full, logits_at=torch.full_like(lengths, tokens.shape[1] - 1)[:, None])",
        "parity_tests/test_generate.py -k 'ragged or identical'",
        "prefill reads the logits of the padded last column instead of each row's last real token",
    ),
    m(
        "generate-device-loop-key-jax",
        "model",
        "jaxattn/generate.py",
        "# the loop's step t\n        token, done, cache = decode(stop, state, token, done, cache, key, step)",
        "# the loop's step t\n        token, done, cache = decode(stop, state, token, done, cache, key, step - 1)",
        "parity_tests/test_generate.py -k device_loop_yields",
        "the device loop draws step t with step t-1's key (the host loop's samples, shifted: same greedy tokens)",
    ),
    m(
        "generate-eos-feed-jax",
        "model",
        "jaxattn/generate.py",
        "(jnp.where(done, feed, token)[:, None], cache=cache)",
        "(token[:, None], cache=cache)",
        "parity_tests/test_generate.py -k feeds_a_stopped",
        "JAX's decode step feeds a stopped row its own last token, not the EOS the host loop fed it",
    ),
    m(
        "pipeline-stage-ignores-segments-torch",
        "pipeline",
        "torchref/pipeline.py",
        "x = run_layer(layer, self.remat, x, cos, sin, segment_ids, None, mask)",
        "x = run_layer(layer, self.remat, x, cos, sin, None, None, mask)",
        "parity_tests/test_pipeline.py -k 'whole_model_stage or cli_parallel_pp_trains'",
        "a torch pipeline stage attends across the documents of a packed row",
    ),
    m(
        "pipeline-last-stage-unpacked-torch",
        "pipeline",
        "torchref/pipeline.py",
        "self.schedule.step(target=targets, losses=losses, **packed)",
        "self.schedule.step(target=targets, losses=losses)",
        "parity_tests/test_pipeline.py -k cli_parallel_pp_trains",
        "the last torch pipeline stage gets no segment ids: its layers read a packed row as one document",
    ),
    m(
        "pipeline-fused-unweighted-torch",
        "pipeline",
        "torchref/pipeline.py",
        "packed.update(targets=targets.contiguous(), weights=weights)",
        "packed.update(targets=targets.contiguous(), weights=torch.ones_like(weights))",
        "parity_tests/test_pipeline.py -k cli_parallel_pp_trains",
        "the last torch stage's fused loss counts every target, each packed document's first one too",
    ),
    m(
        "pipeline-compile-ignored-torch",
        "pipeline",
        "torchref/pipeline.py",
        "for m in self.modules if compile else ():",
        "for m in ():",
        "parity_tests/test_pipeline.py -k compiled_stages",
        "torch's Pipeline(compile=True) runs its stages eagerly",
    ),
    m(
        "pipeline-moe-terms-unweighted-torch",
        "pipeline",
        "torchref/pipeline.py",
        "loss = (loss + self.moe_scale / self.microbatches * terms) * self.loss_scale",
        "loss = (loss + self.moe_scale * terms) * self.loss_scale",
        "parity_tests/test_pipeline.py -k moe_pipelines",
        "torch's last stage adds every micro-batch's router terms at full weight, not 1/m",
    ),
    m(
        "pipeline-moe-sums-dropped-torch",
        "pipeline",
        "torchref/pipeline.py",
        "before = router[0] if router else x.new_zeros(",
        "before = x.new_zeros(",
        "parity_tests/test_pipeline.py -k moe_pipelines",
        "a torch stage drops the router sums the earlier stages passed on (the loss sees the last stage's layers)",
    ),
    m(
        "pipeline-microbatches-contiguous-torch",
        "pipeline",
        "torchref/pipeline.py",
        'order = torch.arange(rows, device=batch["tokens"].device).reshape(rows // m, m).T.flatten()',
        'order = torch.arange(rows, device=batch["tokens"].device)',
        "parity_tests/test_pipeline.py -k moe_pipelines",
        "torch's micro-batches are contiguous row blocks, JAX's strided: their MoE router terms differ",
    ),
    m(
        "pipeline-moe-bubble-stats-jax",
        "pipeline",
        "jaxattn/pipeline.py",
        "real = (t - s >= 0) & (t - s < v * m)",
        "real = t >= 0",
        "parity_tests/test_pipeline.py -k moe_pipelines",
        "a JAX stage's bubble steps overwrite a micro-batch's router sums",
    ),
    m(
        "pipeline-moe-microbatch-sums-jax",
        "pipeline",
        "jaxattn/moe.py",
        'if stats["tokens"].ndim == 2:  # [m, L]',
        'if stats["tokens"].ndim == 2:  # [m, L]\n'
        "        stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)\n    if False:",
        "parity_tests/test_pipeline.py -k moe_pipelines",
        "JAX's MoE terms pool a pipeline's micro-batches (the whole batch's router sums), not each its own",
    ),
    m(
        "parallel-rows-ignore-accum-blocks-torch",
        "moe",
        "torchref/parallel.py",
        'return row_block(batch, n, rank, f"the {n} data-parallel ranks ({mode})", blocks)',
        'return row_block(batch, n, rank, f"the {n} data-parallel ranks ({mode})")',
        "parity_tests/test_moe_train.py -k 'torchrun_expert_parallel and ep-capacity'",
        "torch's data-parallel ranks take consecutive row blocks: under --grad-accum a rank's accumulation block j is "
        "not its share of the batch's block j, so an MoE's per-block router terms differ from one process's",
    ),
    m(
        "generate-eos-compiled-in-jax",
        "model",
        "jaxattn/generate.py",
        "current_backends(), bool(eos), spec)",
        "current_backends(), eos, spec)",
        "parity_tests/test_generate.py -k another_eos",
        "JAX's step programs are cached per EOS set again: another set of stop ids compiles them anew",
    ),
    m(
        "generate-id-check-per-step-torch",
        "model",
        "torchref/generate.py",
        "with trusted_ids():\n                return _sample_finite(step_fn(model",
        "with nullcontext():\n                return _sample_finite(step_fn(model",
        "parity_tests/test_generate.py -k no_device_sync",
        "torch's decode steps check their ids (a device sync) every step: the queued loop waits on the GPU per token",
    ),
    m(
        "generate-device-loop-no-stop-jax",
        "model",
        "jaxattn/generate.py",
        "lambda c: (c[0] < last) & ~c[3].all()",
        "lambda c: c[0] < last",
        "parity_tests/test_generate.py -k stop_when",
        "the device loop never stops early: every generation runs max_new_tokens steps after all rows ended",
    ),
    m(
        "generate-device-loop-slot-torch",
        "model",
        "torchref/generate.py",
        "        ids[step] = token\n",
        "        ids[step - 1] = token\n",
        "parity_tests/test_generate.py -k device_loop_yields",
        "torch's queued loop writes each step's ids into the previous step's row",
    ),
    m(
        "generate-device-loop-chunk-end-jax",
        "model",
        "jaxattn/generate.py",
        "last = 1 + chunks * check_every",
        "last = chunks * check_every",
        "parity_tests/test_generate.py -k device_loop_yields",
        "JAX's chunked device loop (a GPU's) counts its whole chunks from step 0, not 1, and runs one chunk too few",
    ),
    m(
        "generate-device-loop-last-chunk-jax",
        "model",
        "jaxattn/generate.py",
        "jax.lax.cond(carry[3].all(), lambda c: c, steps(rest), carry)",
        "jax.lax.cond(carry[3].all(), steps(rest), lambda c: c, carry)",
        "parity_tests/test_generate.py -k device_loop_yields",
        "JAX's chunked device loop runs its last, shorter chunk only when every row has already stopped",
    ),
    m(
        "generate-kept-cache-lengths-torch",
        "model",
        "torchref/generate.py",
        "for t in (cache.k, cache.v, cache.lengths):",
        "for t in (cache.k, cache.v):",
        "parity_tests/test_generate.py -k graph_mode_keeps",
        "the cache kept for CUDA graphs keeps the last call's lengths, so the next prompt is placed after them",
    ),
    m(
        "generate-kept-cache-values-torch",
        "model",
        "torchref/generate.py",
        "for t in (cache.k, cache.v, cache.lengths):",
        "for t in (cache.lengths,):",
        "parity_tests/test_generate.py -k graph_mode_keeps",
        "the cache kept for CUDA graphs is not zeroed: a stale NaN in a masked slot reaches the output",
    ),
    m(
        "generate-kept-cache-shared-torch",
        "model",
        "torchref/generate.py",
        "if cache is not None and id(cache) in _IN_USE:",
        "if False:",
        "parity_tests/test_generate.py -k graph_mode_cache_held",
        "a second call takes the kept cache from a stream still running and empties it under it",
    ),
    m(
        "compile-data-dependent-check",
        "model",
        "torchref/model.py",
        'if not torch.compiler.is_compiling() and not getattr(_TRUSTED, "on", False):',
        "if True:",
        "parity_tests/test_generate.py -k traced_whole",
        "the token-id check's host sync left in the compiled decode step (a graph break under fullgraph=True)",
    ),
    m(
        "gguf-unpermute",
        "model",
        "twincore/gguf.py",
        "return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)",
        "return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)",
        "parity_tests/test_gguf.py -k 'synthetic_file_loads or smollm2_logits'",
        "llama.cpp's q/k row permutation undone with the halves' axes the wrong way round (RoPE pairs scrambled)",
    ),
    m(
        "int8-scale",
        "model",
        "jaxattn/quant.py",
        "scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)",
        "scale = np.where(amax > 0, amax / np.float32(128), np.float32(1)).astype(np.float32)",
        "parity_tests/test_quant.py -k 'bit_identical or rounding_rule'",
        "the int8 scale over 128 (the twins' rounding grids part)",
    ),
    # ---- sliding-window attention (Mistral)
    m(
        "sliding-window-off-by-one",
        "model",
        "twincore/config.py",
        "return None if self.sliding_window is None else (self.sliding_window - 1, None)",
        "return None if self.sliding_window is None else (self.sliding_window, None)",
        "parity_tests/test_model.py -k 'sliding_window or hidden_states'",
        "the window holds w + 1 tokens, not w (HF's kv > q - w read as kv >= q - w), in both twins alike",
    ),
    m(
        "sliding-window-ignored-jax",
        "model",
        "jaxattn/model.py",
        "functools.partial(_self_attention, window=cfg.attention_window)",
        "functools.partial(_self_attention, window=None)",
        "parity_tests/test_model.py -k 'full_model_logits'",
        "JAX's training forward attends over every earlier token of a windowed model",
    ),
    m(
        "sliding-window-decode-jax",
        "model",
        "jaxattn/kv_cache.py",
        "seen = (back <= last) & (back < window)",
        "seen = (back <= last) & (back <= window)",
        "parity_tests/test_kv_cache.py -k cache_decode",
        "a JAX decode step sees one slot more than the window (the prefill and the full forward do not)",
    ),
    m(
        "sliding-window-decode-torch",
        "model",
        "torchref/kv_cache.py",
        "visible = (back <= last) & (back < self.window)",
        "visible = back < self.window",
        "parity_tests/test_kv_cache.py -k cache_decode",
        "a torch decode step shows a short row the padded prefill's slots it has not written yet",
    ),
    m(
        "sliding-window-prefill-torch",
        "model",
        "torchref/kv_cache.py",
        "return dot_product_attention(q, k, v, causal=True, window=window)",
        "return dot_product_attention(q, k, v, causal=True)",
        "parity_tests/test_kv_cache.py -k cache_decode",
        "torch's prefill of a windowed model attends over the whole prompt",
    ),
    m(
        "sliding-window-from-hf",
        "model",
        "twincore/config.py",
        'w = _hf_int(hf, "sliding_window", None, null_means="full attention")',
        'w = _hf_int(hf, "sliding_window", None, null_means="full attention") and None',
        "parity_tests/test_hf.py -k mistral",
        "a Mistral config.json's sliding_window is read as full attention",
    ),
    m(
        "ring-write-jax",
        "model",
        "jaxattn/kv_cache.py",
        "return jnp.arange(lengths.shape[0])[:, None], cols % t if ring else cols",
        "return jnp.arange(lengths.shape[0])[:, None], cols",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'cache_decode or ring'",
        "a JAX ring writes past its last slot (clamped to it) instead of wrapping to slot 0",
    ),
    m(
        "ring-stale-slots-jax",
        "model",
        "jaxattn/kv_cache.py",
        "seen = (back <= last) & (back < window)",
        "seen = back < window",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'cache_decode or ring'",
        "a JAX ring shows a short row the padded prefill's slots it has not written yet",
    ),
    m(
        "ring-window-torch",
        "model",
        "torchref/kv_cache.py",
        "visible = (back <= last) & (back < self.window)",
        "visible = (back <= last) & (back <= self.window)",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'cache_decode or ring'",
        "a torch ring step sees one position more than the window (the slot about to be overwritten)",
    ),
    m(
        "ring-slots-generate",
        "model",
        "twincore/generate.py",
        "return slots if window is None or slots <= window else window + chunk - 1\n",
        "return slots if window is None or slots <= window else window + chunk - 2\n",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'cache_decode or ring'",
        "generate sizes a ring smaller than the window where the prefill is shorter (the window's oldest lost)",
    ),
    m(
        "ring-fold-jax",
        "model",
        "jaxattn/kv_cache.py",
        "last = self.lengths[:, None] - 1  # [B, 1]",
        "last = self.lengths[:, None]  # [B, 1]",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'ring or windowed or fold'",
        "JAX's prefill keeps a window one position too new in the ring (a pad token's key in, the oldest one out)",
    ),
    m(
        "ring-fold-torch",
        "model",
        "torchref/kv_cache.py",
        "at = torch.clamp(last - (last - j) % slots, min=0)",
        "at = torch.clamp(last - (last + j) % slots, min=0)",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'ring or windowed or fold'",
        "torch's prefill puts the window's positions in the ring's slots in the wrong order",
    ),
    m(
        "cpu-default-decode",
        "attention",
        "twincore/attention.py",
        "and (q_len is None or q_len >= dict(self.default_min_q).get(platform, 1))",
        "and (q_len is None or q_len >= 1)",
        "parity_tests/test_attention.py -k default_backend_on_cpu",
        "a decode step on a CPU goes to `chunked` by default, which scans key blocks for one query (5x slower)",
    ),
    m(
        "cpu-default-kv-floor",
        "attention",
        "jaxattn/attention/__init__.py",
        "names = _resolve(backend, target, q.shape[1], k.shape[1])",
        "names = _resolve(backend, target, q.shape[1], q.shape[1])",
        "parity_tests/test_attention.py -k default_backend_on_cpu",
        "the dispatcher floors `chunked` by the queries' length, so a prefill of a few tokens into a long cache "
        "and an appending chunk pick the backend from the wrong length",
    ),
    # ---- torch's FlexAttention (torchref/flex_attention.py) and chunked's skipping
    m(
        "flex-alignment",
        "attention",
        "torchref/flex_attention.py",
        "offset = sk - sq  # bottom-right",
        "offset = 0  # bottom-right",
        "parity_tests/test_flex_attention.py -k oracle",
        "FlexAttention's mask aligns causal top-left, not bottom-right, when Sq != Sk",
    ),
    m(
        "flex-softcap-scale",
        "attention",
        "torchref/flex_attention.py",
        "return softcap * torch.tanh(score / softcap)",
        "return torch.tanh(score / softcap)",
        "parity_tests/test_flex_attention.py -k oracle",
        "the score function caps the scores at 1 instead of at softcap",
    ),
    m(
        "flex-stale-block-mask",
        "attention",
        "torchref/flex_attention.py",
        "key = (sq, sk, causal, window, device, q_ids._version, kv_ids._version)",
        "key = (sq, sk, causal, window, device)",
        "parity_tests/test_flex_attention.py -k stale",
        "the block-mask cache serves the last mask after the segment ids were edited in place",
    ),
    m(
        "flex-list-order",
        "attention",
        "torchref/attention.py",
        "        if n == FLEX or not out or out[-1] == (FLEX,):\n            out.append((n,))",
        "        if n == FLEX or not out or out[-1] == (FLEX,):\n            out.insert(0, (n,))",
        "parity_tests/test_flex_attention.py -k falls_through",
        "a backend list is tried out of order: ('cudnn', 'flex') tries flex first, ('flex', 'xla') xla first",
    ),
    m(
        "chunked-ids-skip-any-row",
        "attention",
        "jaxattn/attention/chunked.py",
        "ok = ok & meet.any()",
        "ok = ok & meet.all()",
        "parity_tests/test_attention.py -k 'skips_a_block or fp32_parity'",
        "chunked skips a block the segment ids hide in one row though another row sees it",
    ),
    m(
        "chunked-heads-order",
        "attention",
        "jaxattn/attention/chunked.py",
        "return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, s, hkv * g, d)",
        "return jnp.transpose(x, (0, 3, 2, 1, 4)).reshape(b, s, hkv * g, d)",
        "parity_tests/test_attention.py -k 'fp32_parity and not sweep'",
        "chunked's output back from its heads-major layout with the query heads of a kv group out of order (GQA)",
    ),
    m(
        "xla-heads-order",
        "attention",
        "jaxattn/attention/xla.py",
        "out = jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, Sq, Hkv, G, D]",
        "out = jnp.transpose(out, (0, 3, 2, 1, 4))  # [B, Sq, Hkv, G, D]",
        "parity_tests/test_attention.py -k 'fp32_parity and not sweep'",
        "the xla backend's output back from its heads-major layout with a kv group's query heads out of order (GQA)",
    ),
    m(
        "chunked-bwd-mask-order",
        "attention",
        "jaxattn/attention/chunked.py",
        "m = jnp.broadcast_to(m[..., None, :], m.shape[:-1] + (g, cfg.cq)).reshape(m.shape[:-1] + (s.shape[-1],))",
        "m = jnp.broadcast_to(m[..., None], m.shape + (g,)).reshape(m.shape[:-1] + (s.shape[-1],))",
        "parity_tests/test_attention.py -k 'fp32_parity and not sweep'",
        "chunked's transposed backward lays its mask out (query, head) where the scores are (head, query) (GQA)",
    ),
    m(
        "chunked-cpu-chunks",
        "attention",
        "jaxattn/attention/chunked.py",
        'return (CPU_CHUNK, CPU_CHUNK) if platform == "cpu" else',
        'return (CPU_CHUNK, CPU_CHUNK) if platform == "cuda" else',
        "parity_tests/test_attention.py -k default_chunks",
        "the CPU's 256-row chunks never apply (a platform name typo): windowed calls 1.7x slower, numbers unchanged",
    ),
    m(
        "append-order-jax",
        "model",
        "jaxattn/kv_cache.py",
        "at = (lengths[:, None] + s + jnp.arange(t)[None, :]) % t",
        "at = (lengths[:, None] + s - 1 + jnp.arange(t)[None, :]) % t",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'appending or windowed'",
        "JAX's appending call reads the cache's slots one position off (the newest key where the oldest should be)",
    ),
    m(
        "append-window-jax",
        "model",
        "jaxattn/kv_cache.py",
        "causal=True, segment_ids=ids, window=contract_window",
        "causal=True, segment_ids=ids",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'appending or windowed'",
        "JAX's appending call of a windowed model attends past the window",
    ),
    m(
        "append-kept-torch",
        "model",
        "torchref/kv_cache.py",
        "kept = torch.ones_like(pos, dtype=torch.bool) if self.ring else pos < t",
        "kept = pos < t",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'appending or windowed'",
        "torch's appending call drops the writes past the end of a ring too, instead of wrapping them",
    ),
    m(
        "append-filled-torch",
        "model",
        "torchref/kv_cache.py",
        "visible = (order % t, (order >= 0).long())",
        "visible = (order % t, (order > 0).long())",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'appending or windowed'",
        "torch's appending call hides position 0 (an off-by-one in which slots are filled)",
    ),
    m(
        "chunk-logits-jax",
        "model",
        "jaxattn/generate.py",
        "mine = (lengths - 1 >= start) & (lengths - 1 < start + chunk)",
        "mine = (lengths - 1 > start) & (lengths - 1 < start + chunk)",
        "parity_tests/test_generate.py -k 'windowed'",
        "JAX's chunked prefill loses the logits of a row whose last token opens a chunk",
    ),
    m(
        "chunk-logits-torch",
        "model",
        "torchref/generate.py",
        "at = (lengths - 1 - start).clamp(0, chunk - 1)[:, None]",
        "at = (lengths - 1 - start).clamp(0, chunk)[:, None]",
        "parity_tests/test_generate.py -k 'windowed'",
        "torch's chunked prefill reads a row's logits past the chunk it is in",
    ),
    m(
        "append-window-check",
        "model",
        "twincore/batch.py",
        "if is_ring(max_len, window) and s > max_len - window + 1:",
        "if is_ring(max_len, window) and s > max_len - window + 2:",
        "parity_tests/test_kv_cache.py -k 'appending'",
        "an appending call one token too long for its ring is let through (its last write hides its first key)",
    ),
    m(
        "kv-cache-layer-index",
        "model",
        "jaxattn/model.py",
        "(k, v, i, lengths, append)",
        "(k, v, 0, lengths, append)",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'cache_decode or ring'",
        "every layer of JAX's carried cache (the GPU's and TPU's programs) writes and reads layer 0's slots",
    ),
    m(
        "kv-cache-write-forgets-the-ring",
        "model",
        "jaxattn/model.py",
        "cache_after = cache.written(k, v, cfg.sliding_window)",
        "cache_after = cache.written(k, v)",
        "parity_tests/test_kv_cache.py parity_tests/test_generate.py -k 'cache_decode or ring'",
        "JAX's write of every layer's keys after the layer scan (the CPU's programs) takes a ring for a plain cache",
    ),
    m(
        "conversation-drops-the-last-reply-token",
        "model",
        "twincore/generate.py",
        "new = [p if first else [r[-1], *p] for r, p in zip(self.rows or prompts, prompts)]",
        "new = [p if first else list(p) for r, p in zip(self.rows or prompts, prompts)]",
        "parity_tests/test_generate.py -k 'conversation_turns and torch'",
        "a conversation's next turn starts at its prompt: the last reply's final token never reaches the cache",
    ),
    m(
        "conversation-held-counts-the-drawn-token",
        "model",
        "twincore/generate.py",
        "self.held = held + lengths + np.asarray([len(a) for a in replies]) - 1",
        "self.held = held + lengths + np.asarray([len(a) for a in replies])",
        "parity_tests/test_generate.py -k 'conversation_turns and torch'",
        "the cache's length after a turn counts the last drawn token, which was never written: a stale slot is seen",
    ),
    m(
        "conversation-jax-logits-at-the-position",
        "model",
        "jaxattn/generate.py",
        "logits_at=(new - 1)[:, None])  # [B, 1, V]",
        "logits_at=(held + new - 1)[:, None])  # [B, 1, V]",
        "parity_tests/test_generate.py -k 'conversation_turns and jax'",
        "JAX's turn program reads the logits at each row's position in the conversation, not in the call",
    ),
    m(
        "chat-turn-sends-the-history-again",
        "model",
        "twincore/chat.py",
        "return whole[len(history) :], False",
        "return whole, False",
        "parity_tests/test_generate.py -k 'chat_turns or next_turn'",
        "an --interactive --chat turn appends the whole rendered conversation to a cache that already holds it",
    ),
    m(
        "chat-reply-left-out-of-the-messages",
        "model",
        "twincore/chat.py",
        'messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})',
        "pass",
        "parity_tests/test_generate.py -k 'chat_turns or next_turn'",
        "the template renders the next turn without the model's reply: the model never sees what it said",
    ),
    m(
        "chat-system-message-dropped",
        "model",
        "twincore/chat.py",
        "system = system_message(args)  # --system: the conversation's first message",
        "system = []",
        "parity_tests/test_generate.py -k 'chat_turns or system'",
        "an --interactive conversation forgets --system: the model never sees the system message",
    ),
    m(
        "interactive-turn-gets-a-bos",
        "model",
        "twincore/chat.py",
        "ids += (tokenizer.encode(user) if ids else encode_prompt(tokenizer, user)) + list(reply)",
        "ids += encode_prompt(tokenizer, user) + list(reply)",
        "parity_tests/test_generate.py -k 'interactive_answers or next_turn'",
        "every raw --interactive turn starts with the tokenizer's BOS, as if it began a new document",
    ),
    m(
        "interactive-drops-the-newest-exchange",
        "model",
        "twincore/chat.py",
        "            exchanges.pop(0)\n            dropped += 1",
        "            exchanges.pop()\n            dropped += 1",
        "parity_tests/test_generate.py -k interactive_drops",
        "a conversation over --max-len drops its newest exchange instead of its oldest: the last reply is forgotten",
    ),
    m(
        "interactive-undo-resets-all",
        "model",
        "twincore/chat.py",
        "            elif exchanges:\n                exchanges.pop()",
        "            elif exchanges:\n                exchanges.clear()",
        "parity_tests/test_generate.py -k interactive_drops",
        "/undo forgets every exchange, not only the last",
    ),
    m(
        "interactive-continuation-ignored",
        "model",
        "twincore/chat.py",
        'if not line.endswith("\\\\"):',
        "if True:",
        "parity_tests/test_generate.py -k backslash",
        "a line ending in a backslash is sent as a turn of its own instead of going on in the next line",
    ),
    m(
        "conversation-torch-compile-ignored",
        "model",
        "torchref/generate.py",
        "self._step = compiled_step(self.cache, self.compile_mode) if self.compile else _decode_step",
        "self._step = _decode_step",
        "parity_tests/test_generate.py -k 'conversation_compiled or interactive_compiles'",
        "torch's Conversation(compile=True) runs its decode steps eagerly: the flag is taken and nothing compiles",
    ),
    m(
        "xla-decode-scale",
        "attention",
        "jaxattn/attention/xla.py",
        "s = jnp.transpose(s, (0, 2, 3, 1))[:, :, :, None] * args.scale",
        "s = jnp.transpose(s, (0, 2, 3, 1))[:, :, :, None]",
        "parity_tests/test_attention.py -k 'fp32_parity and Sq1-'",
        "the xla backend's one-query path (a decode step) forgets the softmax scale",
    ),
    # ---- AdamW8bit on FSDP2's row shards
    m(
        "adamw8bit-fsdp-state-not-sharded",
        "training",
        "torchref/optim.py",
        "return DTensor.from_local(local, p.device_mesh, [Shard(0)], run_check=False)",
        "return local",
        "parity_tests/test_parallel.py -k fsdp_runs_adamw8bit",
        "an fsdp run's 8-bit state is each rank's plain tensor: the checkpoint keeps one rank's blocks for all",
    ),
    m(
        "adamw8bit-fsdp-local-threshold",
        "training",
        "torchref/optim.py",
        "quantised = p.numel() >= self.min_8bit_size  # the whole parameter's size, sharded or not",
        "quantised = _local(p).numel() >= self.min_8bit_size",
        "parity_tests/test_parallel.py -k fsdp_runs_adamw8bit",
        "under fsdp a parameter is 8-bit by its shard's size: a 4096-element weight keeps float32 moments on 2 ranks",
    ),
    # ---- JAX 8-bit AdamW under a mesh: moments by row, split as their params
    m(
        "adamw8bit-jax-absmax-replicated",
        "training",
        "jaxattn/sharding.py",
        "return NamedSharding(mesh, P(*codes_sharding.spec[:-1]))",
        "return NamedSharding(mesh, P())",
        "parity_tests/test_sharding.py -k adamw8bit_moments_split",
        "every device holds every absmax of a sharded 8-bit moment (and XLA gathers them each step)",
    ),
    m(
        "adamw8bit-jax-rows-axis-dropped",
        "training",
        "jaxattn/sharding.py",
        "                grid[i], moved = None, [*moved, a]",
        "                grid[i] = None",
        "parity_tests/test_sharding.py -k adamw8bit_moments_split",
        "an axis that cannot split a row's blocks is dropped, not moved to the rows: the moment replicated over it",
    ),
    m(
        "adamw8bit-jax-stage-seam-unset",
        "training",
        "jaxattn/sharding.py",
        '    stages = _axis_size(mesh, ("stage",)) if RULES["layers"] == "stage" else 1',
        "    stages = 1",
        "parity_tests/test_sharding.py -k adamw8bit_walks",
        "with pipeline stages the 8-bit update walks the stage-split layer axis: every layer gathered to every stage",
    ),
    m(
        "adamw8bit-jax-layer-loop-short",
        "training",
        "jaxattn/optim.py",
        "out = jax.lax.fori_loop(0, shares[0].shape[1], body, shares)",
        "out = jax.lax.fori_loop(0, shares[0].shape[1] - 1, body, shares)",
        "parity_tests/test_optim.py -k five_step_trajectory",
        "the per-layer 8-bit update skips the last layer of each share: its moments never move",
    ),
    m(
        "adamw8bit-jax-rows-any-width",
        "training",
        "jaxattn/optim.py",
        "return len(shape) > b and shape[-1] % block_size == 0",
        "return len(shape) > b and shape[-1] >= block_size",
        "parity_tests/test_optim.py -k five_step_trajectory",
        "a row wider than a block but not a whole number of them is held by row: its tail never fits",
    ),
    m(
        "adamw8bit-jax-flat-checkpoint-not-migrated",
        "training",
        "jaxattn/checkpoint.py",
        '            return {_path(p): tuple(x.shape) for p, x in leaves if hasattr(x, "shape")}',
        "            return {}",
        "parity_tests/test_checkpoint.py -k flat_moments",
        "a checkpoint of flat 8-bit moments no longer resumes after they are held by row",
    ),
    # ---- GGUF tokenizers: llama.cpp's pre-tokenizer families
    m(
        "gguf-qwen2-digit-runs",
        "model",
        "twincore/gguf.py",
        "r\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?",
        "r\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?",
        "parity_tests/test_gguf.py -k pre_tokenizers",
        "a Qwen2 GGUF tokenizer keeps digit runs together (Qwen2 splits one digit at a time)",
    ),
    m(
        "gguf-llama3-merges-not-ignored",
        "model",
        "twincore/gguf.py",
        "PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)",
        "PreTokenizer(_LLAMA3_SPLIT, add_bos=True)",
        "parity_tests/test_gguf.py -k pre_tokenizers",
        "a Llama 3 GGUF tokenizer runs the merges over a piece that is a whole token (llama.cpp's ignore_merges)",
    ),
    m(
        "gguf-llama3-no-default-bos",
        "model",
        "twincore/gguf.py",
        "return tok, pre.add_bos",
        "return tok, False",
        "parity_tests/test_gguf.py -k pre_tokenizers",
        "a Llama 3 GGUF file without add_bos_token gets no BOS (llama.cpp adds one for that family)",
    ),
    m(
        "gguf-rope-freqs-ignored",
        "model",
        "twincore/gguf.py",
        'kw["rope_scaling"] = llama3_scaling_from_factors(factors, kw["rope_theta"], head_dim, where)',
        'factors = llama3_scaling_from_factors(factors, kw["rope_theta"], head_dim, where)',
        "parity_tests/test_gguf.py -k 'synthetic_file or llama3'",
        "a Llama 3.1 GGUF file's rope_freqs.weight is read and dropped: the model rotates without its RoPE scaling",
    ),
    m(
        "gguf-rope-freqs-unchecked",
        "model",
        "twincore/gguf.py",
        "if np.allclose(llama3_factors(scaling, rope_theta, head_dim), f, rtol=1e-5, atol=0):",
        "if True:",
        "parity_tests/test_gguf.py -k 'bad_files or llama3'",
        "any rope_freqs.weight is taken for Llama 3's scaling: the fitted dict is never checked against the divisors",
    ),
    m(
        "chat-template-without-special-tokens",
        "model",
        "twincore/chat.py",
        "variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}",
        "variables = {}",
        "parity_tests/test_tokenizer.py parity_tests/test_gguf.py -k 'transformers or survive'",
        "a chat template's {{ bos_token }} / {{ eos_token }} render empty: Llama 3's chat prompt loses its BOS",
    ),
    m(
        "hf-tokenizer-bos-ignored",
        "model",
        "twincore/tokenizer.py",
        "self.add_bos = self.bos_id is not None and first == [self.bos_id]",
        "self.add_bos = False",
        "parity_tests/test_tokenizer.py parity_tests/test_gguf.py -k 'transformers or survive'",
        "a directory whose tokenizer.json puts a BOS first (Llama 3) gets prompts without it",
    ),
    m(
        "gguf-spm-lowest-score-merges-first",
        "model",
        "twincore/gguf.py",
        "ranked += [(-float(scores[i]), i, t[:j], t[j:])",
        "ranked += [(float(scores[i]), i, t[:j], t[j:])",
        "parity_tests/test_gguf.py -k sentencepiece",
        "a SentencePiece GGUF tokenizer ranks its merges by the lowest score first",
    ),
    m(
        "gguf-spm-no-space-prefix",
        "model",
        "twincore/gguf.py",
        'tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces',
        "tok.normalizer = spaces",
        "parity_tests/test_gguf.py -k sentencepiece",
        "a SentencePiece GGUF tokenizer never puts the '▁' of add_space_prefix before the text",
    ),
    m(
        "gguf-spm-no-byte-fallback",
        "model",
        "twincore/gguf.py",
        "unk_token=unk, fuse_unk=True, byte_fallback=True",
        "unk_token=unk, fuse_unk=True, byte_fallback=False",
        "parity_tests/test_gguf.py -k sentencepiece",
        "a character outside a SentencePiece GGUF vocabulary becomes <unk> instead of its UTF-8 byte tokens",
    ),
    # ---- Qwen3 (dense)
    m(
        "qwen3-dense-without-qk-norm",
        "model",
        "twincore/config.py",
        "return self.model_type in QWEN3_TYPES",
        'return self.model_type == "qwen3_moe"',
        "parity_tests/test_hf.py -k qwen3",
        "a dense Qwen3 runs without its q/k norms (only the MoE family keeps them)",
    ),
    m(
        "qwen3-gguf-rows-unpermuted",
        "model",
        "twincore/gguf.py",
        'if permute is not None and arch == "llama":',
        'if permute is not None and arch in ("llama", "qwen3"):',
        "parity_tests/test_gguf.py -k synthetic_file",
        "a Qwen3 GGUF's q/k rows un-permuted as if llama.cpp had permuted them (it does so for Llama only)",
    ),
    # ---- Qwen2 (biased q / k / v)
    m(
        "qwen2-q-bias-dropped-jax",
        "model",
        "jaxattn/model.py",
        'linear(x, p["wq"], p.get("q_bias"))',
        'linear(x, p["wq"])',
        "parity_tests/test_model.py -k full_model_logits",
        "JAX's query projection forgets Qwen2's bias",
    ),
    m(
        "qwen2-bias-decayed-jax",
        "model",
        "twincore/optim.py",
        'parts[-1].split("_")[-1] == "bias"',
        'parts[-1] == "bias"',
        "parity_tests/test_optim.py -k decay",
        "weight decay on JAX's q / k / v biases (named q_bias ...), which torch's q_proj.bias never gets",
    ),
    m(
        "qwen2-int8-bias-dropped-torch",
        "model",
        "torchref/quant.py",
        "self.scale.to(x.dtype)[:, None], bias)",
        "self.scale.to(x.dtype)[:, None])",
        "parity_tests/test_quant.py -k qwen2",
        "torch's int8 linear drops the float bias it kept",
    ),
)


# ---- running


def check_mutant(mut: Mutant, root: Path) -> list[str]:
    """The problems with ``mut`` against the tree at ``root`` (empty when every edit applies exactly once, in order,
    and every test file it names exists)."""
    problems, texts = [], {}
    for path, old, new in mut.edits:
        file = root / path
        if not file.is_file():
            problems.append(f"{mut.name}: {path} does not exist")
            continue
        text = texts.get(path, file.read_text())
        n = text.count(old)
        if n != 1:
            problems.append(f"{mut.name}: {path} has {n} copies of {old[:60]!r} (needs exactly 1)")
            continue
        if old == new:
            problems.append(f"{mut.name}: an edit of {path} changes nothing")
        texts[path] = text.replace(old, new)
    for arg in shlex.split(mut.tests):
        file = arg.split("::")[0]
        if file.endswith(".py") and not (root / file).is_file():
            problems.append(f"{mut.name}: test file {file} does not exist")
    return problems


def copy_repo(dst: Path) -> Path:
    """The checkout's tracked and untracked-but-not-ignored files copied under ``dst`` (returned)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            target = dst / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dst


def _env(copy: Path) -> dict:
    # not the caller's pytest state (an xdist worker's, or CI's rule that fails a run where every compile test
    # skipped: a mutant's few tests may hold only skipped ones, which would read as caught)
    drop = ("PYTEST_", "JAXATTN_REQUIRE_COMPILE_TESTS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH", "")]))
    env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    return env


def check_imports(copy: Path) -> None:
    """Refuses to go on unless the packages import from the copy (an installed copy must not shadow it)."""
    code = "import jaxattn, torchref, benchmarks, parity_tests; print(jaxattn.__file__, torchref.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=_env(copy), capture_output=True, text=True)
    if out.returncode or any(not Path(p).resolve().is_relative_to(copy.resolve()) for p in out.stdout.split()):
        raise SystemExit(f"mutants: the packages do not import from the copy {copy}: {out.stdout}{out.stderr}")


def run_tests(copy: Path, tests: str, timeout: float) -> tuple[int | None, float, str]:
    """``(pytest's exit status or None on timeout, seconds, the first failing test or the last output line)``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:warnings", "-m", SELECT]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(
            cmd + shlex.split(tests), cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return out.returncode, seconds, failed[0] if failed else (lines[-1] if lines else out.stderr.strip()[-200:])


def verdict(rc: int | None) -> str:
    return {0: "missed", 1: "caught"}.get(rc, "error")


def run_mutant(mut: Mutant, copy: Path, timeout: float) -> dict:
    originals = {}
    try:
        for path, old, new in mut.edits:
            file = copy / path
            text = file.read_text()
            originals.setdefault(path, text)
            if text.count(old) != 1:
                return {"name": mut.name, "area": mut.area, "verdict": "error", "seconds": 0.0,
                        "detail": f"{path}: the edit does not apply exactly once"}  # fmt: skip
            file.write_text(text.replace(old, new))
        rc, seconds, detail = run_tests(copy, mut.tests, timeout)
    finally:
        for path, text in originals.items():
            (copy / path).write_text(text)
    return {"name": mut.name, "area": mut.area, "verdict": verdict(rc), "seconds": round(seconds, 1), "detail": detail}


def markdown(results: list[dict], header: str) -> str:
    caught = sum(r["verdict"] == "caught" for r in results)
    lines = [
        header,
        "",
        f"**{caught} of {len(results)} caught** ({100 * caught / max(len(results), 1):.0f}%) by the default run.",
        "",
        "| mutant | area | verdict | s | first failing test (or why) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| `{r['name']}` | {r['area']} | {r['verdict']} | {r['seconds']:.0f} | {detail} |")
    return "\n".join(lines) + "\n"


def select(names: list[str] | None, areas: list[str] | None) -> list[Mutant]:
    known, known_areas = {x.name for x in MUTANTS}, {x.area for x in MUTANTS}
    bad = [n for n in names or [] if n not in known] + [a for a in areas or [] if a not in known_areas]
    if bad:
        raise ValueError(f"unknown mutant or area {bad}; mutants: {sorted(known)}; areas: {sorted(known_areas)}")
    return [x for x in MUTANTS if (not names or x.name in names) and (not areas or x.area in areas)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m parity_tests.mutants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", action="append", metavar="NAME", help="run this mutant (repeatable)")
    p.add_argument("--area", action="append", metavar="AREA", help="run this area's mutants (repeatable)")
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    p.add_argument("--check", action="store_true", help="check that every edit applies; run no test")
    p.add_argument("--baseline", action="store_true", help="first run each distinct selection unmutated")
    p.add_argument("--jobs", type=int, default=1, help="mutants at a time, each in its own copy (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's tests (default 900)")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        p.error(f"--jobs must be >= 1 and --timeout > 0, got {args.jobs} and {args.timeout}")
    try:
        chosen = select(args.only, args.area)
    except ValueError as e:
        p.error(str(e))
    if args.list:
        for x in chosen:
            print(f"{x.name:<32}{x.area:<12}{x.why}")
        return 0
    problems = [msg for x in chosen for msg in check_mutant(x, ROOT)]
    if problems or args.check:
        print("\n".join(problems) or f"all {len(chosen)} mutants apply to this tree")
        return 1 if problems else 0

    with tempfile.TemporaryDirectory(prefix="jaxattn-mutants-") as tmp:
        copies: queue.Queue = queue.Queue()
        for j in range(args.jobs):
            copies.put(copy_repo(Path(tmp) / f"copy{j}"))
        check_imports(Path(tmp) / "copy0")
        invalid = set()
        if args.baseline:
            for tests in dict.fromkeys(x.tests for x in chosen):
                rc, seconds, detail = run_tests(Path(tmp) / "copy0", tests, args.timeout)
                print(f"baseline {'ok' if rc == 0 else 'FAILS'} ({seconds:.0f} s): {tests}", flush=True)
                if rc != 0:
                    invalid.add(tests)

        def work(mut: Mutant) -> dict:
            if mut.tests in invalid:
                return {"name": mut.name, "area": mut.area, "verdict": "invalid", "seconds": 0.0,
                        "detail": "its tests fail unmutated"}  # fmt: skip
            copy = copies.get()
            try:
                r = run_mutant(mut, copy, args.timeout)
            finally:
                copies.put(copy)
            print(f"{r['verdict']:<8}{r['seconds']:>7.1f} s  {r['name']:<32} {r['detail']}", flush=True)
            return r

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(work, chosen))
        total = time.perf_counter() - t0
    caught = sum(r["verdict"] == "caught" for r in results)
    print(f"\n{caught} of {len(results)} mutants caught in {total:.0f} s")
    header = f"Mutation check: `python -m parity_tests.mutants --jobs {args.jobs}`, {total:.0f} s."
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, header))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "seconds": round(total, 1)}, indent=1) + "\n")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
