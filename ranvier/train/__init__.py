"""Training: losses, optimizers, schedules, the trainers and their options, checkpoints
and run directories' settings (the jobs behind `ranvier train` are the application's, in
`ranvier/jobs/`). `compile_step` (a training step from a PyTorch module or an ONNX model)
is imported when first used, so the command line's jobs do not load it."""

_STEP = ("CompiledStep", "compile_step", "read_state_dict")


def __getattr__(name: str):
    if name in _STEP:
        from . import step

        return getattr(step, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
