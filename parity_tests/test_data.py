"""The data pipeline (``twincore.data`` + ``jaxattn.data`` / ``torchref.data``), numpy and CPU only.

* byte tokenizer round trip; packing: segment ids count documents per row, positions restart at every segment
  start, the tail is padding (loss mask 0, segment 0); bucket mode pads to the fixed bucket lengths only;
* ``batch(i)`` is a function of the seed and ``i`` only: the same seed gives the same batches (a fresh Dataset,
  any access order), another seed other batches; JAX's prefetch and torch's DataLoader (with a worker process)
  deliver exactly those batches in the same order;
* sources: text file, folder, ``.npy`` (1-D / 2-D), a ``tokenizer.json`` via ``tokenizers``; bad ids and bad
  sources are errors naming ``--data`` and the value.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from twincore.data import ByteTokenizer, Dataset, bucket_lengths, load_tokenizer, pack_rows, read_documents


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo\n")
    assert all(isinstance(i, int) for i in ids) and max(ids) < 256 and len(ids) == 7
    assert tok.decode(ids) == "héllo\n"


def test_pack_rows_segments_positions_and_padding():
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 27)]  # 5 + 3 + 7 = 15 tokens, rows of 6
    rows = pack_rows(docs, 6)
    np.testing.assert_array_equal(
        rows["tokens"], [[1, 2, 3, 4, 5, 10], [11, 12, 20, 21, 22, 23], [24, 25, 26, 0, 0, 0]]
    )
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 1, 2], [1, 1, 2, 2, 2, 2], [1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 4, 0], [0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 0, 0]])
    np.testing.assert_array_equal(rows["loss_mask"], [[1] * 6, [1] * 6, [1, 1, 1, 0, 0, 0]])


@pytest.mark.parametrize("packing", ["pack", "bucket"])
@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_batches_are_a_function_of_seed_and_index(tmp_path, packing, source):
    if source == "text":
        source = str(tmp_path / "a.txt")
        (tmp_path / "a.txt").write_text("The quick brown fox. " * 40)
    kw = dict(seq_len=32, batch_size=3, packing=packing)
    a = Dataset.from_source(source, seed=1, **kw)
    b = Dataset.from_source(source, seed=1, **kw)
    c = Dataset.from_source(source, seed=2, **kw)
    order = [7, 0, 3, 7, 1]
    first = [a.batch(i) for i in order]
    second = [b.batch(i) for i in reversed(order)][::-1]
    for x, y in zip(first, second):
        assert x.keys() == y.keys() == {"tokens", "loss_mask", "segment_ids", "positions"}
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
            assert x[k].dtype == np.int32
    assert any(not np.array_equal(a.batch(i)["tokens"], c.batch(i)["tokens"]) for i in range(4))
    widths = {a.batch(i)["tokens"].shape[1] - 1 for i in range(12)}
    assert widths <= set(a.buckets)
    assert all(a.batch(i)["tokens"].shape[0] == 3 for i in range(12))


def test_bucket_lengths():
    assert bucket_lengths(128) == (16, 32, 64, 128)
    assert bucket_lengths(16) == (8, 16)
    assert bucket_lengths(5) == (5,)


def test_epochs_cover_every_row_and_reshuffle(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 2)  # 512 tokens = 16 rows of 33 (last padded)
    ds = Dataset.from_source(str(tmp_path / "a.txt"), seq_len=32, batch_size=4, seed=0)
    n = ds.batches_per_epoch()
    assert n == 4
    epoch0 = np.concatenate([ds.batch(i)["tokens"] for i in range(n)])
    epoch1 = np.concatenate([ds.batch(i)["tokens"] for i in range(n, 2 * n)])
    rows = pack_rows(read_documents(str(tmp_path / "a.txt")), 33)["tokens"]
    key = lambda a: sorted(map(bytes, a.astype(np.uint8)))  # noqa: E731
    assert key(epoch0) == key(epoch1) == key(rows)
    assert not np.array_equal(epoch0, epoch1)


def test_sources_folder_npy_and_errors(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("second")
    (tmp_path / "d" / "a.txt").write_text("first")
    np.save(tmp_path / "d" / "c.npy", np.array([[1, 2, 3], [4, 5, 6]]))
    docs = read_documents(str(tmp_path / "d"))
    assert [d.tolist() for d in docs] == [list(b"first"), list(b"second"), [1, 2, 3], [4, 5, 6]]
    np.save(tmp_path / "bad.npy", np.array([1, 2, 300]))
    with pytest.raises(ValueError, match=r"--data .*bad\.npy.*vocab_size=256.*: 300 at position \(2,\)"):
        Dataset.from_source(str(tmp_path / "bad.npy"), seq_len=8, batch_size=1)
    np.save(tmp_path / "f.npy", np.zeros((2, 2, 2), np.int32))
    with pytest.raises(ValueError, match=r"--data .*f\.npy.*1-D.*2-D"):
        read_documents(str(tmp_path / "f.npy"))
    with pytest.raises(ValueError, match=r"--data .*nope.*no such file"):
        read_documents(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"--packing 'zip'.*pack, bucket"):
        Dataset(None, seq_len=8, batch_size=1, packing="zip")


def test_tokenizer_json_is_used(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({}))
    t = load_tokenizer(str(tmp_path))
    assert t.vocab_size == 3
    assert t.encode("hello world hello nope") == [1, 2, 1, 0]
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_jax_prefetch_and_torch_loader_deliver_the_same_batches():
    torch = pytest.importorskip("torch")
    from jaxattn.data import prefetch_to_device
    from torchref.data import loader

    ds = Dataset.from_source("synthetic", seq_len=16, batch_size=2, seed=3, packing="bucket")
    want = [ds.batch(i) for i in range(2, 7)]
    got_jax = list(prefetch_to_device(ds, 2, 7))
    got_torch = list(loader(ds, 2, 7, num_workers=0))  # workers: the CLI runs of test_checkpoint
    assert len(got_jax) == len(got_torch) == 5
    for w, j, t in zip(want, got_jax, got_torch):
        for k in w:
            np.testing.assert_array_equal(np.asarray(j[k]), w[k])
            assert t[k].dtype == torch.int32
            np.testing.assert_array_equal(t[k].numpy(), w[k])


def test_jax_prefetch_thread_has_ended_when_the_iterator_is_closed():
    """A consumer that stops early (the trainer's divergence stop) closes the iterator: its thread must have ended
    by then. A daemon thread still inside ``jax.device_put`` at interpreter exit aborts the process (exit 134,
    ``terminate called after throwing ...``) instead of the trainer's exit 1."""
    import threading
    import time

    from jaxattn.data import prefetch_to_device

    ds = Dataset.from_source("synthetic", seq_len=16, batch_size=2, seed=3, packing="bucket")
    placing = threading.Event()

    def slow_place(host):  # a device_put that takes a while (the window the abort needs)
        placing.set()
        time.sleep(0.5)
        return host

    batches = prefetch_to_device(ds, 0, 100, place=slow_place)
    next(batches)
    placing.clear()
    assert placing.wait(5)  # the thread is placing a later batch
    batches.close()
    assert not [t for t in threading.enumerate() if t.name == "prefetch_to_device"]
