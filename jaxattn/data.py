"""Host -> device input pipeline for the JAX trainer (twin of ``torchref.data``): the numpy batches of
``twincore.data`` moved to the device by a background thread, double-buffered.

    ds = Dataset.from_source("synthetic", seq_len=128, batch_size=8, seed=0)
    for batch in prefetch_to_device(ds, start=0, stop=100):    # jax arrays already on the device
        state, metrics = step(state, batch)

The thread builds batch ``i + 1`` (and ``i + 2`` with ``size=2``) and starts its ``jax.device_put`` while the
device runs step ``i`` (flax's ``prefetch_to_device`` idea, for one device; ``device_put`` is asynchronous, so the
copy overlaps compute). Each batch's dict holds int32 ``tokens``, ``loss_mask``, ``segment_ids``, ``positions``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import jax

from twincore.data import PACKING, SYNTHETIC, ByteTokenizer, Dataset, HFTokenizer, bucket_lengths, load_tokenizer

__all__ = [
    "Dataset",
    "prefetch_to_device",
    "load_tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "bucket_lengths",
    "PACKING",
    "SYNTHETIC",
]

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def prefetch_to_device(
    ds: Dataset,
    start: int,
    stop: int,
    *,
    size: int = 2,
    device: Any | None = None,
    with_tokens: bool = False,
    place: Any | None = None,
) -> Iterator[Any]:
    """Batches ``start .. stop - 1`` of ``ds`` on ``device`` (default: the first device; or a sharding), ``size``
    ahead; ``with_tokens``: yield ``(batch, real input tokens)`` pairs (counted on the host, no device sync).
    ``place(host_batch)`` replaces the ``device_put`` (e.g. ``lambda b: b`` keeps host batches for a
    multi-process step that builds its global arrays itself)."""
    if size < 1:
        raise ValueError(f"size={size!r} must be >= 1 (batches in flight)")
    device = jax.devices()[0] if device is None else device
    if place is None:

        def place(host):
            return jax.device_put(host, device)

    q: queue.Queue = queue.Queue(maxsize=size)
    stopped = threading.Event()

    def put(item) -> bool:
        while not stopped.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def worker():
        try:
            for i in range(start, stop):
                host = ds.batch(i)
                batch = place(host)
                if not put((batch, ds.tokens_in(host)) if with_tokens else batch):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer
            put(_Failure(e))

    thread = threading.Thread(target=worker, name="prefetch_to_device", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stopped.set()
        # and ended: a daemon thread still in jax.device_put at interpreter exit aborts the process (exit 134,
        # "terminate called after throwing ..."), e.g. after the trainer's divergence stop; it stops at its next put
        thread.join()
