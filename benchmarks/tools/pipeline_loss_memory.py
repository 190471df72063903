"""The torch pipeline's loss on the last stage, dense against fused: the step's peak RSS growth and its step time,
one process per loss (``benchmarks/NOTES.md``, "The fused loss in torch's pipeline stages"; CPU only: RSS).

    python -m benchmarks.tools.pipeline_loss_memory dense
    python -m benchmarks.tools.pipeline_loss_memory fused

One rank plays both stages (``interleaved``, 2 virtual stages, 4 micro-batches of 2 rows of 128 tokens) of a
2-layer dim-64 model with a 32,768-token vocabulary, so one micro-batch's float32 logits are 32 MiB.
"""

import resource
import sys
import time

import torch
import torch.distributed as dist

from torchref.config import ModelConfig
from torchref.model import LlamaForCausalLM
from torchref.pipeline import Pipeline


def main(loss: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = ModelConfig(
        vocab_size=32768,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=160,
        max_seq_len=256,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    pipe = Pipeline(model, "interleaved", 4, virtual=2, loss=loss, loss_chunk=256)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (8, 129))}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        pipe.step(batch)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{loss} peak_rss_growth_MiB {(peak - base) / 1024:.0f} step_s {sorted(times[1:])[1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fused")
