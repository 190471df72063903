"""jax's own FA3-style Mosaic GPU attention (``attention_mgpu``) as the attention suite's ``pallas:mgpu`` peer: its
contract (``benchmarks/mgpu_peer.py``) declines what the op cannot take, each time with the reason, and on a machine
without a GPU the suite records it as skipped (GPU only), never a crash. The deviceless compile of its kernels:
``test_gpu_compile.py``."""

import pytest

from benchmarks import mgpu_peer
from benchmarks.suites import attention as attention_suite


def test_contract_takes_what_the_op_takes():
    for dt in ("float16", "bfloat16", "fp16", "bf16"):
        assert mgpu_peer.unsupported(dt, 16, 16, 4096, 128, False) is None
        assert mgpu_peer.unsupported(dt, 16, 16, 4096, 128, False, backward=True) is None
    assert mgpu_peer.unsupported("bfloat16", 16, 4, 4096, 64, False, backward=True) is None  # GQA: dk, dv summed
    assert mgpu_peer.unsupported("float16", 8, 1, 1024, 256, False) is None  # MQA, D=256 at block_kv=64
    assert [mgpu_peer.block_kv(d) for d in (64, 128, 256, 512)] == [256, 128, 64, None]
    assert mgpu_peer.run_dtype("bfloat16") == mgpu_peer.run_dtype("bf16") == "float16"
    assert mgpu_peer.run_dtype("float16") == "float16"


@pytest.mark.parametrize(
    "args, kw, reason",
    [
        (("float32", 8, 8, 256, 64, False), {}, "float16 / bfloat16 only, got float32"),
        (("fp32", 8, 8, 256, 64, False), {}, "got float32"),
        (("bfloat16", 8, 8, 256, 96, False), {}, "multiple of 64, got D=96"),
        (("bfloat16", 8, 8, 1024, 512, False), {}, "fits shared memory at D=512"),
        (("bfloat16", 6, 4, 1024, 64, False), {}, "Hq a multiple of Hkv, got Hq=6, Hkv=4"),
        (("bfloat16", 8, 8, 4160, 128, False), {}, "S a multiple of 2*block_q=128 and block_kv=128, got S=4160"),
        (("bfloat16", 8, 8, 4096, 128, True), {"backward": True}, "no causal backward"),
    ],
)
def test_contract_declines_with_the_reason(args, kw, reason):
    got = mgpu_peer.unsupported(*args, **kw)
    assert got is not None and reason in got, got


def test_causal_forward_follows_the_ops_own_cuda_check(monkeypatch):
    """The op refuses causal masking on CUDA runtimes 12.8.0 <= v < 12.9.1; the contract says so by name, with the
    version it read (a runtime's, else the plugin's build version)."""
    monkeypatch.setattr(mgpu_peer, "cuda_runtime_version", lambda: (12090, "the loaded CUDA runtime"))
    reason = mgpu_peer.unsupported("bfloat16", 16, 16, 4096, 128, True)
    assert reason is not None and "CUDA runtime 12090" in reason and "12.8.0 <= version < 12.9.1" in reason
    monkeypatch.setattr(mgpu_peer, "cuda_runtime_version", lambda: (13000, "the loaded CUDA runtime"))
    assert mgpu_peer.unsupported("bfloat16", 16, 16, 4096, 128, True) is None
    monkeypatch.setattr(mgpu_peer, "cuda_runtime_version", lambda: (None, "no jax CUDA plugin"))
    assert mgpu_peer.unsupported("bfloat16", 16, 16, 4096, 128, True) is None


def test_tuning_config_is_the_ops_default_on_this_jax():
    pytest.importorskip("jax.experimental.pallas.ops.gpu.attention_mgpu")
    cfg = mgpu_peer.tuning_config(128, causal=True)
    assert (cfg.block_q, cfg.block_kv, cfg.max_concurrent_steps, cfg.causal) == (64, 128, 2, True)
    assert (
        cfg.has_backward_blocks
        and cfg.compute_wgs_bwd == 2
        and mgpu_peer.tuning_config(256, False).compute_wgs_bwd == 1
    )


def test_suite_peer_is_gpu_only_then_hopper_only_then_the_contract():
    shape = ("bfloat16", 1, 16, 16, 4096, 128, True)
    assert "GPU only" in attention_suite.mgpu_reason(shape, platform="cpu")
    assert "Hopper only" in attention_suite.mgpu_reason(shape, platform="gpu", compute_capability="8.0")
    assert "no causal backward" in attention_suite.mgpu_reason(
        shape, backward=True, platform="gpu", compute_capability="9.0"
    )
    fp32 = ("float32", 2, 8, 8, 256, 64, False)
    assert "got float32" in attention_suite.mgpu_reason(fp32, platform="gpu", compute_capability="9.0")
    ok = ("bfloat16", 1, 16, 16, 4096, 128, False)
    assert attention_suite.mgpu_reason(ok, backward=True, platform="gpu", compute_capability="9.0") is None


def test_suite_records_the_peer_as_skipped_with_the_reason_here():
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: the peer is timed")
    assert "pallas:mgpu" in attention_suite.JAX_PEERS and "pallas:mgpu" in attention_suite.IMPLS
    records = []
    shape = attention_suite._shapes(True)[0]
    attention_suite._run_jax(records, True, shape, 1, 0, wanted={"pallas:mgpu"})
    assert [(r["impl"], r["pass"], r["status"]) for r in records] == [
        ("pallas:mgpu", "fwd", "skipped"),
        ("pallas:mgpu", "fwd_bwd", "skipped"),
    ]
    assert all(r["reason"].startswith("GPU only (Mosaic GPU") for r in records)
    assert attention_suite.check_filters(True, impls=["pallas:mgpu"])


def test_a_record_run_at_another_dtype_says_so_in_the_tables():
    """The peer's bfloat16 rows run on float16 copies: its column in the report and the README's GPU table name
    the dtype it ran at, so no table shows it as a bfloat16 measurement."""
    from benchmarks.report import readme
    from benchmarks.report.records import impl_label

    rec = {"framework": "jax", "impl": "pallas:mgpu", "dtype": "bfloat16", "run_dtype": "float16"}
    assert impl_label(rec) == "jax:pallas:mgpu as float16"
    assert readme._gpu_label(rec) == "pallas:mgpu as float16"  # a peer, not ours
    assert readme._gpu_label({"framework": "jax", "impl": "mosaic"}) == "ours: mosaic"
    assert impl_label({"framework": "jax", "impl": "flash"}) == "jax:flash"
