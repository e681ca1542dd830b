"""`ranvier plot RUN_DIR`: the loss (training and validation) and learning-rate curves of a
run, from its metrics.jsonl, as a PNG."""

from __future__ import annotations

import io
from pathlib import Path

from .atomic import atomic_write_bytes
from .errors import RanvierError, brief, parse_json

CURVES = ("loss", "val_loss", "lr")


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The (step, value) points of each of CURVES in the run's metrics.jsonl, or an error
    naming the line that is not a record of numbers."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise RanvierError(f"{run_dir} has no metrics.jsonl: is it a run directory?")
    curves: dict[str, list[tuple[int, float]]] = {key: [] for key in CURVES}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        record = parse_json(line, RanvierError, f"{path} line {number} is not JSON")
        if not isinstance(record, dict):
            raise RanvierError(f"{path} line {number} is {brief(record)}, expected a JSON object")
        for key in CURVES:
            if key in record:
                step, value = record.get("step"), record[key]
                if type(step) is not int or type(value) not in (int, float):
                    raise RanvierError(f"{path} line {number}: {key} {brief(value)} at step {brief(step)}, "
                                       "expected a number at an integer step")
                curves[key].append((step, value))
    return curves


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the curves to `out` (default RUN_DIR/curves.png) and return its path."""
    series = read_curves(run_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RanvierError("plotting needs matplotlib: pip install 'ranvier[plot]'") from None
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
