"""Child of ``parity_tests/test_parallel.py``, run under ``torchrun`` (gloo, CPU): for each mode in argv[1]
(comma-separated ``torchref.parallel.MODES``), train the tiny model for STEPS steps parallelized and in one
process (every rank computes the reference itself, no collectives); rank 0 writes the losses to argv[2] (JSON)."""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from torchref import parallel
from torchref.model import LlamaForCausalLM
from torchref.train_step import make_train_step
from twincore.config import ModelConfig

STEPS, BATCH, SEQ = 3, 4, 16
CFG = ModelConfig.preset("tiny", n_kv_heads=2)


def batches():
    rng = np.random.default_rng(0)
    return [
        {"tokens": torch.from_numpy(rng.integers(0, CFG.vocab_size, (BATCH, SEQ + 1)).astype(np.int64))}
        for _ in range(STEPS)
    ]


def train(mode, eight_bit: bool = False, weights: dict | None = None, states: list | None = None):
    """Losses and gradient norms of STEPS steps (AdamW, or AdamW8bit); ``weights`` (a dict) receives the final
    weights, whole, by name; ``states`` (a list) each 8-bit code or absmax tensor's placement: ``"rows"``
    for a DTensor split as its parameter's rows, else its type and placements."""
    from torchref.optim import AdamW8bit

    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    mesh = None
    if mode is not None:
        mesh = parallel.build_mesh(mode)
        model = parallel.parallelize(model, mode, mesh)
    if eight_bit:
        opt = AdamW8bit(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    step = make_train_step(model, opt, max_grad_norm=1.0)
    losses, norms = [], []
    for b in batches():
        m = step(b if mode is None else parallel.local_rows(b, mode, mesh))
        loss = m["loss"].detach().float().reshape(1)
        if mode is not None and parallel.dp_size(mode, mesh) > 1:  # the mean over equal-size row blocks
            dist.all_reduce(loss, op=dist.ReduceOp.AVG if dist.get_backend() != "gloo" else dist.ReduceOp.SUM)
            if dist.get_backend() == "gloo":
                loss /= parallel.dp_size(mode, mesh)
        losses.append(float(loss))
        gn = m["grad_norm"]
        norms.append(float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn))
    if states is not None:
        for st in opt.state.values():
            for key in ("m_codes", "m_absmax", "v_codes", "v_absmax"):
                if key in st:
                    v = st[key]
                    rows = [getattr(x, "dim", None) == 0 and x.is_shard() for x in getattr(v, "placements", ())]
                    states.append(
                        "rows" if rows and all(rows) else f"{type(v).__name__} {getattr(v, 'placements', '')}"
                    )
    if weights is not None:
        for name, p in model.named_parameters():
            weights[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return losses, norms


def adamw8bit_fsdp() -> dict:
    """AdamW8bit on fsdp's row shards against one process: the losses, the norms, per weight the largest
    difference and the share of entries more than 1e-5 apart, and the 8-bit state's placements."""
    one, two, states = {}, {}, []
    ref, got = train(None, True, one), train("fsdp", True, two, states)
    diffs = {
        k: ((two[k] - one[k]).abs().max().item(), ((two[k] - one[k]).abs() > 1e-5).float().mean().item()) for k in one
    }
    return {"reference": ref, "fsdp": got, "weights": diffs, "states": states}


def adamw8bit_refusal(mode) -> str:
    """The error ``AdamW8bit`` gives on ``mode``'s DTensor parameters (tensor parallel: column shards), or ""."""
    from torchref.optim import AdamW8bit

    torch.manual_seed(0)
    mesh = parallel.build_mesh(mode)
    model = parallel.parallelize(LlamaForCausalLM(CFG), mode, mesh)
    opt = AdamW8bit(model.parameters(), lr=1e-3)
    for p in model.parameters():  # gradients placed like their parameters, made without a collective
        p.grad = torch.ones_like(p)
    try:
        opt.step()  # refuses before any parameter moves, so no collective is left in flight either
    except ValueError as e:
        return str(e)
    return ""


def main():
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    out = {"reference": train(None)}
    for mode in sys.argv[1].split(","):
        out[mode] = train(mode)
    out["adamw8bit_tp"] = adamw8bit_refusal("tp")
    out["adamw8bit_fsdp"] = adamw8bit_fsdp()
    if dist.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)
    dist.barrier()  # no rank leaves (and closes its sockets) while another still has work in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
