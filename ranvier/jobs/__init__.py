"""The application beneath the `ranvier` command: its training jobs (`ranvier train mnist`,
`ranvier train llama|moe`,
`ranvier train onnx`), which print progress and own a run directory each (claimed,
configured, logged, resumed: `rundir.py`), and the rate a run's share of peak is taken
against. The library (`train`, `interop`, ...) imports nothing of it: a run directory is
read back through `train/runs.py`."""
