"""Memory planning: shared storage never corrupts a value that is still needed."""

from __future__ import annotations

import pytest

from ranvier.models import MLP
from ranvier.train.classifier import build_classifier
from ranvier.train.optimizers import Adam
from ranvier.train.trainer import Trainer


def overlapping(a, b) -> bool:
    return a.offset < b.offset + b.size and b.offset < a.offset + a.size


def storage_owner(var, slots) -> str:
    """The variable whose bytes `var` is: itself, or for a reshape sharing its input's
    storage, that input's owner."""
    producer = var.producer
    if producer is not None and producer.type in ("Reshape", "ExpandDims", "Squeeze"):
        source = producer.inputs[0]
        if source.name in slots and slots[source.name].offset == slots[var.name].offset:
            return storage_owner(source, slots)
    return var.name


def check_plan(cell) -> None:
    """Two variables may share bytes only when one is dead before the other is written,
    or an op writes its output exactly over an input it reads for the last time, or
    one is a view (reshape) of the other, both living as long as either."""
    slots = {s.var.name: s for s in cell.slots}
    for a in cell.slots:
        for b in cell.slots:
            if a is b or not overlapping(a, b) or a.last < b.first or b.last < a.first:
                continue
            shared = (a.offset, a.size, a.first, a.last) == (b.offset, b.size, b.first, b.last)
            if shared and storage_owner(a.var, slots) == storage_owner(b.var, slots):
                continue
            later, earlier = (a, b) if a.first >= b.first else (b, a)
            op = cell.steps[later.first].op if later.first >= 0 else None
            assert op is not None and earlier.last == later.first and earlier.var in op.inputs, (a.var.name, b.var.name)
            assert later.offset == earlier.offset, f"{later.var.name} partially overlaps {earlier.var.name}, which {op.name} still reads"
    assert len(slots) == len(cell.slots)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_training_cell_plan_is_sound(backend):
    setup = build_classifier(MLP([784, 16, 10]), [784], 128)
    trainer = Trainer(setup.loss, setup.params, Adam(1e-3), inputs=[setup.x, setup.labels], backend=backend)
    check_plan(trainer.cell)
    assert any(s.offset == t.offset and s is not t for s in trainer.cell.slots for t in trainer.cell.slots)  # reuse happens
