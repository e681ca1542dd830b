"""One rank of the data-parallel tests, run as `mpiexec -n N python tests/dp_worker.py JSON`.

The same builders make the single-process oracle inside the test process. The job is a
JSON object: model ("mlp": a Trainer sampling its dataset; "stack": a CheckpointedStack
fed explicit global batches), backend (default "cpu"), zero, accumulate, steps, first (the step to start from,
resuming `load` if given), save (a checkpoint folder to write at the end), out (the
folder each rank writes rank<r>.npz into: its losses and final state), fail: "kill"
or "hang" rank 1 after `fail_at` steps, and poison_at: at that step the last rank's rows
hold an infinity ("mlp" with dynamic loss scaling: every rank must skip the step).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from ranvier.flow.builder import Builder
from ranvier.flow.graph import Flow
from ranvier.models import MLP
from ranvier.models.llama import Llama, LlamaConfig
from ranvier.train.loss_scale import DynamicLossScale
from ranvier.train.losses import softmax_cross_entropy
from ranvier.train.optimizers import Adam, AdamW
from ranvier.train.stack import CheckpointedStack
from ranvier.train.trainer import Trainer

GLOBAL_BATCH = 12  # splits over 1, 2, 3 and 4 ranks, with accumulation 1 or 2 (for 1–3 ranks)
SEQ, VOCAB = 8, 50


def build(job: dict, world=None):
    """The job's trainer, its dataset set (for "mlp"), for `world` (None: this process's)."""
    ranks = world.size if world is not None else _world_size()
    micro = GLOBAL_BATCH // (ranks * job.get("accumulate", 1))
    options = {"accumulate": job.get("accumulate", 1), "zero": job.get("zero", False), "world": world, "clip_norm": 0.5,
               "backend": job.get("backend", "cpu")}
    if "poison_at" in job:
        options["loss_scale"] = DynamicLossScale(initial=2.0**8)
    if job["model"] == "mlp":
        flow = Flow()
        b = Builder(flow, "train")
        x = b.var("x", "float32", [micro, 20])
        labels = b.var("labels", "int32", [micro])
        model = MLP([20, 16, 5], seed=3)
        params = model.parameters(b)
        loss = softmax_cross_entropy(model(b, x, params), labels)
        trainer = Trainer(loss, list(params.values()), Adam(lr=0.01), inputs=[x, labels], **options)
        rng = np.random.default_rng(7)
        trainer.set_dataset([rng.standard_normal((60, 20)).astype(np.float32), rng.integers(0, 5, 60).astype(np.int32)], seed=5)
        return trainer
    config = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, hidden_dim=40, max_seq_len=16)
    types = ("int32", [micro, SEQ])

    def loss(b, logits, targets):
        return softmax_cross_entropy(logits.reshape([micro * SEQ, VOCAB]), targets.reshape([micro * SEQ]))

    return CheckpointedStack(Llama(config, seed=1), types, types, loss, AdamW(lr=0.01), **options)


def global_batch(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.integers(0, VOCAB, (GLOBAL_BATCH, SEQ)).astype(np.int32) for _ in range(2)]


def train(trainer, job: dict, first: int, steps: int, before_step=None) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        if before_step is not None:
            before_step(step)
        if job.get("poison_at") == step:
            x, labels = (trainer.dataset[v.name][: trainer.batch_rows].copy() for v in trainer.inputs)
            x[-1, 0] = np.inf
            losses.append(trainer.step([x, labels]))
        else:
            losses.append(trainer.step(global_batch(step) if job["model"] == "stack" else None))
    return losses


def _world_size() -> int:
    from ranvier.distributed import current_world

    return current_world().size


def main() -> None:
    from ranvier.distributed import current_world

    job = json.loads(sys.argv[1])
    world = current_world()
    trainer = build(job)
    first = 0
    if job.get("load"):
        first = trainer.load(job["load"])["step"]

    def before_step(step: int) -> None:
        if job.get("fail") and world.rank == 1 and step == job["fail_at"]:
            if job["fail"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # "hang": stop answering

    losses = []
    for step in range(first, job["steps"]):
        losses += train(trainer, job, step, 1, before_step)
        if job.get("save") and (step + 1) % job.get("save_every", job["steps"]) == 0:
            trainer.save(job["save"])
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    state = trainer.state_arrays()
    np.savez(out / f"rank{world.rank}.npz", losses=np.array(losses), **{f"state:{k}": v for k, v in state.items()},
             hidden=trainer.reduce_times.hidden, skipped=trainer.skipped_steps if job["model"] == "mlp" else 0)


if __name__ == "__main__":
    main()
