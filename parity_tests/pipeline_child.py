"""Child of ``parity_tests/test_pipeline.py``, run under ``torchrun`` (gloo, CPU): for each schedule in argv[1]
(comma-separated ``torchref.pipeline.SCHEDULES``), train the tiny model (4 layers, untied) for STEPS SGD steps with
pipeline stages and, on every rank, in one process (no collectives); each rank writes its stages' parameter
differences and the last stage's losses to argv[2].<rank> (JSON); argv[3], if given: rank 0 saves the initial
weights there (Hugging Face layout)."""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from torchref.model import LlamaForCausalLM
from torchref.pipeline import Pipeline
from torchref.train_step import loss_weights
from twincore.config import ModelConfig

STEPS, BATCH, SEQ, MICRO = 3, 8, 12, 4
CFG = ModelConfig.preset("tiny", n_layers=4, tie_embeddings=False)


def batches(kind: str = ""):
    """STEPS batches; ``kind`` "masked": each row's first 1..4 tokens are not targets (``loss_mask`` 0); "packed":
    each row two documents, the second starting at a drawn 3..9 (``segment_ids``, ``positions`` restarting)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        b = {"tokens": torch.from_numpy(rng.integers(0, CFG.vocab_size, (BATCH, SEQ + 1)).astype(np.int64))}
        if kind == "masked":
            lead = rng.integers(1, 5, BATCH)
            b["loss_mask"] = torch.from_numpy((np.arange(SEQ + 1)[None] >= lead[:, None]).astype(np.int64))
        if kind == "packed":
            cut = rng.integers(3, 10, BATCH)[:, None]
            t = np.arange(SEQ + 1)[None]
            b["segment_ids"] = torch.from_numpy((t >= cut).astype(np.int64) + 1)
            b["positions"] = torch.from_numpy(np.where(t >= cut, t - cut, t))
        out.append(b)
    return out


def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG)


def reference(kind: str = ""):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for b in batches(kind):
        t, packed = b["tokens"], {k: b[k][:, :-1] for k in ("segment_ids", "positions") if k in b}
        logits = m(t[:, :-1], **packed)
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten(), reduction="none")
        w = loss_weights(b).flatten()  # the loss mask, and no target across a document boundary
        loss = (nll * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return m, losses


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and len(sys.argv) > 3:  # the initial weights, for the JAX twin's pipeline (test_pipeline.py)
        from torchref.hf import save_pretrained

        save_pretrained(model(), sys.argv[3])
    out = {}
    for schedule in sys.argv[1].split(",") + ["gpipe-masked", "1f1b-packed"]:
        name, _, kind = schedule.partition("-")
        ref, ref_losses = reference(kind)
        ref_params = dict(ref.named_parameters())
        m = model()
        pipe = Pipeline(m, name, MICRO)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
        losses = []
        for b in batches(kind):
            opt.zero_grad()
            losses.append(pipe.step(b))
            opt.step()
        mine = {id(p) for p in pipe.parameters()}
        diff = max(
            float((p.detach() - ref_params[n].detach()).abs().max()) for n, p in m.named_parameters() if id(p) in mine
        )
        out[schedule] = {"losses": losses, "ref_losses": ref_losses, "param_diff": diff, "stages": pipe.indices}
        dist.barrier()
    try:  # a key the stages do not take is refused by name, on every rank, before any communication
        pipe.step(dict(batches()[0], labels=batches()[0]["tokens"]))
        out["labels"] = "accepted"
    except ValueError as e:
        out["labels"] = str(e)
    with open(f"{sys.argv[2]}.{rank}", "w") as f:
        json.dump(out, f)
    dist.barrier()  # no rank leaves (and closes its sockets) while another still has work in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
