"""Workers for tests/test_frameworks.py: real frameworks (Hugging Face Trainer, Lightning) on tiny
models built from config, run in each rank by tests.multiproc.run_ranks (gloo, CPU), once without
commpatch and once under it with torch.profiler as the witness."""

from __future__ import annotations

import os
from collections import Counter

from tests.integration_workers import GLOO_RUNS, witness_bytes, witness_counts

STEPS = 4


# what gloo runs for each call (the profiler's names); an object collective: its size, then its data
RUNS = {**GLOO_RUNS, "broadcast_object_list": ("broadcast", "broadcast")}


def _gloo_view(df) -> tuple[dict, dict]:
    """(count, bytes) per gloo op that commpatch's rows say ran, as the profiler names them."""
    from commpatch.data.ops import BY_NAME

    counts, nbytes = Counter(), Counter()
    for op, n in zip(df["op"].astype(str), df["bytes"]):
        runs = [{"reduce_scatter": "all_reduce"}.get(r, r) for r in (BY_NAME[op].runs or RUNS.get(op, (op,)))]
        counts.update(runs)
        if len(set(runs)) == 1:
            nbytes[runs[0]] += int(n)
    return dict(counts), dict(nbytes)


def _witness(prof, world_size, df) -> dict:
    """Both sides per gloo op; bytes only for ops whose every row issues one collective."""
    claimed_counts, claimed_bytes = _gloo_view(df)
    seen_bytes = dict(witness_bytes(prof, world_size))
    return dict(
        counts=(claimed_counts, dict(witness_counts(prof))),
        bytes=(claimed_bytes, {op: seen_bytes.get(op, 0) for op in claimed_bytes}),
    )


def _env(rank, world_size):
    """The variables a launcher (torchrun) sets: the frameworks read them (the default process
    group already exists; they use it)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29850",
    )


def _hf_train(out_dir: str):
    """A 2-layer GPT-2 built from its config, 4 optimizer steps of the HF Trainer (DDP over gloo,
    gradient accumulation 2). Returns the final parameters and the logged losses."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=gen)]
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return params, losses


def hf_trainer(rank, world_size, out_dir):
    import torch
    from torch.profiler import profile

    import commpatch

    _env(rank, world_size)
    base = _hf_train(os.path.join(out_dir, "base"))
    commpatch.enable(output="none")
    with profile(record_shapes=True) as prof:
        got = _hf_train(os.path.join(out_dir, "commpatch"))
    df = commpatch.log()
    errors = commpatch.internal_errors()
    commpatch.disable()
    identical = base[1] == got[1] and all(torch.equal(a, b) for a, b in zip(base[0], got[0]))
    return dict(
        identical=identical, errors=errors, ops=dict(Counter(df["op"].astype(str))), **_witness(prof, world_size, df)
    )


def _lightning_train(rank: int, world_size: int, out_dir: str):
    """A one-layer transformer encoder (a tiny model built from its sizes), 4 steps of Lightning's
    DDP strategy over gloo. Returns the final parameters and the losses of every step."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(
                d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
            )
            self.head = torch.nn.Linear(16, 1)
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.head(self.layer(x)).squeeze(-1), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    _env(rank, world_size)  # Lightning's teardown removes them
    torch.manual_seed(0)
    model = Tiny()
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, 16, generator=gen), torch.randn(32, 4, generator=gen))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        strategy=DDPStrategy(process_group_backend="gloo"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    return [p.detach().clone() for p in model.parameters()], model.losses


def lightning(rank, world_size, out_dir):
    import torch
    from torch.profiler import profile

    import commpatch

    base = _lightning_train(rank, world_size, os.path.join(out_dir, "base"))
    commpatch.enable(output="none")
    with profile(record_shapes=True) as prof:
        got = _lightning_train(rank, world_size, os.path.join(out_dir, "commpatch"))
    df = commpatch.log()
    errors = commpatch.internal_errors()
    commpatch.disable()
    identical = (
        len(base[1]) == len(got[1])
        and all(torch.equal(a, b) for a, b in zip(base[1], got[1]))
        and all(torch.equal(a, b) for a, b in zip(base[0], got[0]))
    )
    return dict(
        identical=identical, errors=errors, ops=dict(Counter(df["op"].astype(str))), **_witness(prof, world_size, df)
    )
