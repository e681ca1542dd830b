"""`ranvier plot RUN_DIR`: the loss (training and validation) and learning-rate curves of a
run, from its metrics.jsonl, as a PNG."""

from __future__ import annotations

import io
import json
from pathlib import Path

from .atomic import atomic_write_bytes
from .errors import RanvierError


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise RanvierError(f"{run_dir} has no metrics.jsonl: is it a run directory?")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise RanvierError(f"{path} line {number} is not JSON: {error}") from None
    return records


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the curves to `out` (default RUN_DIR/curves.png) and return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RanvierError("plotting needs matplotlib: pip install 'ranvier[plot]'") from None
    records = read_metrics(run_dir)
    series = {key: [(r["step"], r[key]) for r in records if key in r] for key in ("loss", "val_loss", "lr")}
    if not series["loss"]:
        raise RanvierError(f"{run_dir / 'metrics.jsonl'} has no training losses to plot")
    figure, (loss_axes, lr_axes) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    loss_axes.plot(*zip(*series["loss"]), label="training loss", linewidth=1)
    if series["val_loss"]:
        loss_axes.plot(*zip(*series["val_loss"]), "o-", label="validation loss")
    loss_axes.set_ylabel("loss")
    loss_axes.set_title(run_dir.name)
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    if series["lr"]:
        lr_axes.plot(*zip(*series["lr"]), color="tab:green")
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("step")
    lr_axes.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    out = out or run_dir / "curves.png"
    atomic_write_bytes(out, buffer.getvalue())
    return out
