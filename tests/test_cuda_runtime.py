"""Cells running on the CUDA backend's device: results equal the CPU backend's, a training
step's parameters stay on the device and come back when the host reaches for them, the
host's writes go out, checkpoints move between backends, bad data fails the step by name,
and each step is timed.

Every test runs on the host emulation of the device (`RANVIER_CUDA_DEVICE=emulator`: the
generated kernels' arithmetic compiled for this CPU, behind the same runtime), and again
on a GPU through the CUDA driver where one is found (skipped elsewhere)."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
from helpers import assert_within_bound, attention_with_gradient, language_model_trainer, random_array
from llvmlite import ir
from test_cuda_codegen import _FakeDriver

import ranvier as rv
from ranvier.backends.cuda import backend, device, driver, resident
from ranvier.backends.cuda.code import CUDACode
from ranvier.backends.cuda.launch import LaunchShape
from ranvier.errors import RanvierError


def _classifier(f):
    """Two dense layers with GELU, a softmax, and a per-row arg-max: products, a fused map,
    a row kernel and a reduction."""
    x = f.var("x", "float32", [24, 40])
    w1, b1 = f.var("w1", "float32", [40, 32]), f.var("b1", "float32", [32])
    w2 = f.var("w2", "float32", [32, 10])
    probs = f.softmax(f.gelu(x @ w1 + b1) @ w2)
    probs.var.out = True
    f.argmax(probs, axis=1).var.out = True
    return {x.name: [24, 40], w1.name: [40, 32], b1.name: [32], w2.name: [32, 10]}


def _outputs(backend_name: str, build, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    flow = rv.Flow()
    build(rv.Builder(flow, "f"))
    data = rv.Compiler(backend_name).compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    return {v.name: np.array(data[v.name]) for v in flow.vars.values() if v.out}


def test_an_inference_cell_computes_on_the_device_what_the_cpu_computes(on_device):
    flow = rv.Flow()
    shapes = _classifier(rv.Builder(flow, "f"))
    values = {name: random_array(shape, "float32", seed=i) * (1 if name == "f/x" else 0.2)
              for i, (name, shape) in enumerate(shapes.items())}
    got, want = _outputs("cuda", _classifier, values), _outputs("cpu", _classifier, values)
    assert set(got) == set(want) and len(got) == 2
    for name, expected in want.items():
        assert np.isfinite(got[name].astype(np.float64)).all(), name  # every element written
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-7, err_msg=name)


def _reshapes(f):
    """Reshapes of values the cell's arena holds: an input, and a product."""
    x, w = f.var("x", "float32", [6, 4, 10]), f.var("w", "float32", [10, 12])
    product = f.reshape(x, [24, 10]) @ w
    (f.reshape(product, [6, 4, 12]) * 2.0).var.out = True
    return {x.name: [6, 4, 10], w.name: [10, 12]}


def test_a_reshape_of_a_value_in_the_cell_launches_nothing(on_device):
    """A reshaped value is its source's bytes: no copy kernel runs for it (it would write
    each element onto itself), and the result is the CPU's."""
    flow = rv.Flow()
    shapes = _reshapes(rv.Builder(flow, "f"))
    values = {name: random_array(shape, "float32", seed=i) for i, (name, shape) in enumerate(shapes.items())}
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    launched = [cell.native.kernels[index] for index, step in enumerate(cell.steps) if step.op.type == "Reshape"]
    assert launched == [[], []]
    got, want = _outputs("cuda", _reshapes, values), _outputs("cpu", _reshapes, values)
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


def _gradient_norm(f):
    """The sum of squares of a gradient of 307,200 elements: a norm for clipping."""
    g = f.var("g", "float32", [300, 1024])
    f.sum_squares(g).var.out = True
    return {g.name: [300, 1024]}


def test_a_long_reduction_to_one_value_runs_in_two_stages_on_the_device(on_device):
    """Not one block of the GPU's 132 multiprocessors over every element: 300 pieces of
    1,024, each a block's, then one block over their sums; the CPU's total to float32's
    summation error."""
    flow = rv.Flow()
    shapes = _gradient_norm(rv.Builder(flow, "f"))
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    staged = [(step.op.type, step.op.inputs[0].shape, [k.elements for k in cell.native.kernels[index]])
              for index, step in enumerate(cell.steps)]
    assert staged == [("SumSquares", [300, 1024], [300]), ("Sum", [300], [1])]
    values = {name: random_array(shape, "float32", seed=9) for name, shape in shapes.items()}
    got, want = _outputs("cuda", _gradient_norm, values), _outputs("cpu", _gradient_norm, values)
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=2e-6, err_msg=name)


COLUMN_SUMS = {  # the summed value, its axes, and the pieces' and results' shapes on the GPU
    "gain": ("float32", [8, 512, 96], [0, 1], [[128, 32, 96], [128, 96]]),  # a gain's gradient over the tokens
    "rows-of-30": ("float32", [3000, 40], [0], [[100, 30, 40], [100, 40]]),  # rows that 32 does not divide
    "bfloat16": ("bfloat16", [2048, 64], [0], [[2048, 64]]),  # kept whole: each piece's result would be rounded
}


@pytest.mark.parametrize("case", sorted(COLUMN_SUMS))
def test_long_columns_reduce_in_pieces_a_thread_each_on_the_device(on_device, case):
    """Not a block per column reading one element a row: pieces of 32 (30) rows, a thread
    per piece of a column, adjacent columns' threads reading a row together, then the
    pieces' sums (a block per column over few rows); float64's sums to float32's
    summation error."""
    dtype, shape, axes, stages = COLUMN_SUMS[case]
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", dtype, shape)
    y = f.sum(x, axis=axes)
    y.var.out = True
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    launched = [(step.op.inputs[0].shape, [k.elements for k in cell.native.kernels[index]])
                for index, step in enumerate(cell.steps) if step.op.type == "Sum"]
    assert launched == [(stage, [math.prod(stage) // stage[-2]]) for stage in stages]
    data = cell.instance()
    data[x] = value = random_array(shape, dtype, seed=10)
    data.compute()
    got = np.array(data[y])
    wide = value.astype(np.float64)
    want, magnitude = wide.sum(axis=tuple(axes)), np.abs(wide).sum(axis=tuple(axes))
    rounding = 2.0**-8 * np.abs(want) if dtype == "bfloat16" else 0.0  # the result's own
    assert_within_bound(got, want, rounding + 1e-6 * magnitude, slack=0.0)


def _trainer(backend_name: str, model: str = "mlp"):
    from ranvier.jobs.mnist import MnistConfig, make_trainer

    trainer, _, test = make_trainer(MnistConfig(steps=12, backend=backend_name, model=model, batch=32, hidden=[48]))
    return trainer, test


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_training_step_on_the_device_follows_the_cpus_losses_and_parameters(on_device, model):
    """Adam on MNIST: the losses of 12 steps, the parameters after them (read back from the
    device) and the accuracy of the trained model (an evaluation cell sharing them)."""
    gpu, test = _trainer("cuda", model)
    cpu, _ = _trainer("cpu", model)
    losses = [(gpu.step(), cpu.step()) for _ in range(12)]
    np.testing.assert_allclose(*zip(*losses), rtol=2e-5)
    assert losses[-1][0] < losses[0][0]
    for name, expected in cpu.network.parameters().items():
        # Adam's step is about ±lr wherever a gradient is tiny, whatever its rounding: 1% of lr
        np.testing.assert_allclose(gpu.network[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    x = test.pixels([784] if model == "mlp" else [1, 28, 28])[:100]
    labels = test.labels[:100]
    assert gpu.accuracy(x, labels) == pytest.approx(cpu.accuracy(x, labels), abs=0.011)


def test_the_hosts_writes_to_parameters_reach_the_device_and_checkpoints_cross_backends(on_device, tmp_path):
    gpu, _ = _trainer("cuda")
    cpu, _ = _trainer("cpu")
    for trainer in (gpu, cpu):
        trainer.network["mlp/W1"][...] *= 0.5  # a host write between steps
        trainer.step()
    assert gpu.step() == pytest.approx(cpu.step(), rel=2e-5)
    gpu.save(tmp_path / "from-gpu")
    resumed, _ = _trainer("cpu")
    resumed.load(tmp_path / "from-gpu")
    assert resumed.step() == pytest.approx(cpu.step(), rel=2e-5)
    cpu.save(tmp_path / "from-cpu")
    back, _ = _trainer("cuda")
    back.load(tmp_path / "from-cpu")
    assert back.step() == pytest.approx(cpu.step(), rel=2e-5)


def test_a_checkpointed_stack_on_the_device_follows_the_cpus_losses_and_parameters(on_device):
    """A CheckpointedStack of two micro-batches a step: the head's and the embedding's
    gradients stay on the device between their cells, and the host adds the first
    micro-batch's to the second's; 3 steps of AdamW with clipping take the CPU's losses
    and leave its parameters and moments."""
    from test_stack import batch, config, stack

    from ranvier.train.optimizers import AdamW

    results = {}
    for backend_name in ("cuda", "cpu"):
        trainer = stack(config(layers=2), optimizer=AdamW(lr=3e-3), clip_norm=0.5, accumulate=2, backend=backend_name)
        losses = []
        for step in range(3):
            (x, y), (x2, y2) = batch(step), batch(step + 10)
            losses.append(trainer.step([np.concatenate([x, x2]), np.concatenate([y, y2])]))
        results[backend_name] = losses, trainer.state_arrays()
    (gpu_losses, gpu_state), (cpu_losses, cpu_state) = results["cuda"], results["cpu"]
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-5)
    assert sorted(gpu_state) == sorted(cpu_state)
    for name, expected in cpu_state.items():
        np.testing.assert_allclose(gpu_state[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_label_out_of_range_fails_the_step_by_name(on_device):
    gpu, _ = _trainer("cuda")
    labels = np.zeros(32, np.int64)
    labels[5] = 10
    batch = [np.random.default_rng(3).integers(0, 256, (32, 784), dtype=np.uint8), labels]
    with pytest.raises(RanvierError, match="SoftmaxCrossEntropyGrad op .* failed on the GPU: an index or class label is out of range"):
        gpu.step(batch)
    labels[5] = 9
    gpu.step(batch)  # the status words start clean again


def test_a_gradient_cell_reads_its_forward_instance_on_the_device(on_device):
    from ranvier.autodiff import gradient

    def network(backend_name: str):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        x, w = f.var("x", "float32", [6, 5]), f.var("w", "float32", [5, 4])
        loss = f.mean(f.tanh(x @ w) * f.tanh(x @ w))
        loss.var.out = True
        grads = gradient(flow, "f", [w], loss=loss, into="gradients/f")
        net = rv.Compiler(backend_name).compile(flow)
        forward = net.cell("f").instance()
        forward[x] = random_array([6, 5], "float32", seed=8)
        forward[w] = random_array([5, 4], "float32", seed=9)
        forward.compute()
        backward = net.cell("gradients/f").instance(primal=forward)
        backward.compute()
        read = next(v for v in backward.cell.external if v.nbytes > 8)  # through the gradient instance
        return np.array(backward[grads[w.name]]), np.array(backward[read]), np.array(forward[read])

    (gpu, read, forward), (cpu, _, _) = network("cuda"), network("cpu")
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(read, forward)  # the forward instance's value, brought back


def test_what_the_host_sets_in_a_forward_instance_reaches_its_gradient_instance_on_the_device(on_device):
    """A gradient instance reads its forward instance's values where they are: a forward
    value the host sets after the forward's compute (here its activation, which the
    gradient reads) is the one the gradient reads, as on the CPU (the device's copy kept
    the computed one)."""
    from ranvier.autodiff import gradient

    def weight_gradient(backend_name: str) -> np.ndarray:
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        x, w = f.var("x", "float32", [6, 5]), f.var("w", "float32", [5, 4])
        activation = f.tanh(x @ w)
        f.sum(activation).var.out = True
        grads = gradient(flow, "f", [w], loss=next(v for v in flow.vars.values() if v.out), into="gradients/f")
        net = rv.Compiler(backend_name).compile(flow)
        forward = net.cell("f").instance()
        forward[x] = random_array([6, 5], "float32", seed=8)
        forward[w] = random_array([5, 4], "float32", seed=9) * 0.3
        forward.compute()
        backward = net.cell("gradients/f").instance(primal=forward)
        assert activation.name in {v.name for v in backward.cell.external}
        forward[activation] = np.tanh(random_array([6, 4], "float32", seed=10))
        backward.compute()
        return np.array(backward[grads[w.name]])

    np.testing.assert_allclose(weight_gradient("cuda"), weight_gradient("cpu"), rtol=1e-5, atol=1e-6)


def test_tensor_handles_and_channels_see_each_computes_values_on_the_device(on_device):
    """Myelin's handles, made once: one reads the latest compute's values (an output the
    device wrote, a global it updated in place), an element written through one reaches
    the next compute; a channel element connected to a computed reference variable
    receives the device's value after each compute."""
    def observe(backend_name: str) -> list:
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        x = f.var("x", "float32", [2, 3])
        w = f.array("w", random_array([3, 4], "float32", seed=2))
        f.tanh(x @ w).var.out = True
        f.op("Assign", [w, w * 0.5])
        g = rv.Builder(flow, "g")
        h = g.var("h", "float32", [1, 4])
        h.var.ref = True
        out = g.tanh(h) + 1.0
        out.var.ref = True
        net = rv.Compiler(backend_name).compile(flow)
        data = net.cell("f").instance()
        y = next(v for v in flow.vars.values() if v.out)
        handles = data.tensor(x), data.tensor(y), net.tensor(w)
        data[x] = random_array([2, 3], "float32", seed=1)
        seen = []
        for step in range(3):
            handles[0][1, step] = 2.0 + step
            data.compute()
            seen += [np.array(handles[1]), handles[1][1, 2], np.array(handles[2])]
        cell = net.cell("g")
        channel = cell.channel(h, 4)
        channel[0][0, 1] = 0.5
        recurrent = cell.instance()
        for t in range(3):
            recurrent.connect(h, channel, t)
            recurrent.connect(out, channel, t + 1)
            recurrent.compute()
        return seen + [np.array(channel[t]) for t in range(4)]

    for got, want in zip(observe("cuda"), observe("cpu"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_learnable_gradient_adds_up_from_zero_and_is_cleared_on_the_device(on_device):
    """A learnable parameter's gradient adds up over computes, from a new instance's zeros,
    until data.clear() zeros it: the device's copy starts and is cleared as the host's (fresh
    emulated memory is NaN, and a cleared host buffer alone left the device's sum)."""
    def gradients(backend_name: str) -> list[np.ndarray]:
        flow = rv.Flow()
        f = rv.Builder(flow, "fit")
        x = f.var("x", "float32", [6, 5])
        w = f.array("w", random_array([5, 4], "float32", seed=9) * 0.3)
        w.var.learnable = True
        f.sum(f.tanh(x @ w)).var.out = True
        f.func.backprop = True
        net = rv.Compiler(backend_name).compile(flow)
        forward = net.cell("fit").instance()
        backward = net.cell("gradients/fit").instance(primal=forward)
        sums = []
        for seed in range(1, 6):
            if seed == 4:  # after a compute whose sum the host has not read
                backward.clear()
            forward[x] = random_array([6, 5], "float32", seed=seed)
            forward.compute()
            backward["gradients/fit/d_Sum:0"] = 1.0
            backward.compute()
            if seed in (2, 5):
                sums.append(np.array(backward["gradients/fit/d_w"]))
        return sums

    gpu, cpu = gradients("cuda"), gradients("cpu")
    for got, want in zip(gpu, cpu):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(cpu[0], cpu[1])  # computes 1 and 2, then 4 and 5


def test_steps_are_timed_on_the_device_when_profiled(on_device):
    """Timing costs a GPU (an event between each two steps, read back after each compute):
    steps are timed from reset_profile() on, and a profile before it says so."""
    gpu, _ = _trainer("cuda")
    gpu.step()
    assert gpu.data.step_time.sum() == 0
    assert "1 computes on" in str(gpu.profile()) and "not timed: a GPU times steps from data.reset_profile() on" in str(gpu.profile())
    gpu.reset_profile()
    for _ in range(3):
        gpu.step()
    profile = gpu.profile()
    assert profile.computes == 3
    assert all(step.seconds > 0 for step in profile.steps)
    assert "cuBLASLt" in str(profile) and "Rows" in str(profile)
    assert f"ms per compute, on {backend._emulator().name if on_device == 'emulator' else ''}" in str(profile)
    assert "cores" not in str(profile)


class _MemoryDriver(_FakeDriver):
    """The device-describing stand-in for libcuda, which also keeps device memory in host
    memory and records each launch, to check what the runtime hands the driver."""

    def __init__(self):
        super().__init__()
        self.launches = []
        self.blocks = []
        self.graph_calls = []
        self.handles = 0

    def __getattr__(self, call: str):
        describe = super().__getattr__(call)

        def run(*args):
            if "Capture" in call or "Graph" in call:
                self.graph_calls.append(call)
            if call == "cuMemAlloc_v2":  # 256-byte aligned, as the driver's memory is
                block = np.zeros(args[1].value + 256, np.uint8)
                self.blocks.append(block)
                args[0]._obj.value = block.ctypes.data + (-block.ctypes.data % 256)
            elif call in ("cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2"):
                ctypes.memmove(args[0].value, args[1].value, args[2].value)
            elif call == "cuModuleLoadDataEx":
                self.loaded = args[1].value
                ctypes.memmove(args[4][0], b"ptxas fatal: unknown target sm_99\0", 34)
                return 218  # CUDA_ERROR_INVALID_PTX
            elif call == "cuGetErrorName" and args[0] == 218:
                args[1]._obj.value = b"CUDA_ERROR_INVALID_PTX"
            elif call in ("cuGraphInstantiateWithFlags", "cuEventCreate") and call not in self.fail:  # a handle of its own each
                self.handles += 1
                args[0]._obj.value = self.handles
            elif call == "cuLaunchKernel":
                function, grid, _, _, threads, _, _, _, _, parameters, _ = args
                count = len(self.last_operands)
                self.launches.append((function, grid, threads, [ctypes.c_uint64.from_address(parameters[i]).value
                                                                for i in range(count)]))
            else:
                return describe(*args)
            return 0

        return run


class _RecordingDriver(_MemoryDriver):
    """The memory-keeping stand-in, which loads any PTX and records every call in `events`."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.last_operands = []  # parameters are not read back here

    def __getattr__(self, call: str):
        run = super().__getattr__(call)

        def record(*args):
            self.events.append((call, args))
            return 0 if call == "cuModuleLoadDataEx" else run(*args)  # this stand-in loads any PTX

        return record


def test_the_driver_is_handed_device_addresses_and_the_launch_shape():
    """What the runtime's launch passes libcuda: the grid and block, and a parameter array
    whose entries point at each operand's 64-bit device address; a compute's launches
    captured from the stream as a graph, run, and replayed; PTX the driver refuses fails
    with its compile log."""
    fake = _MemoryDriver()
    gpu = driver.DriverGPU(lambda name: fake)
    address = gpu.allocate(64)
    values = np.arange(16, dtype=np.float32)
    gpu.upload(address, values)
    back = np.zeros_like(values)
    gpu.download(address, back)
    assert (back == values).all()
    kernel = type("Kernel", (), {"name": "k_f_Add", "dynamic_shared_bytes": 0})()
    fake.last_operands = [address, address + 16, address + 32]
    gpu.launch(driver.DriverKernels({"k_f_Add": "function"}, {}), kernel, LaunchShape(3, 256), fake.last_operands)
    assert fake.launches == [("function", 3, 256, [address, address + 16, address + 32])]
    fake.launches.clear()
    graph = gpu.graph(lambda: gpu.launch(driver.DriverKernels({"k_f_Add": "function"}, {}), kernel, LaunchShape(3, 256), fake.last_operands))
    gpu.replay(graph)
    assert len(fake.launches) == 1  # captured once; the graph runs it
    assert fake.graph_calls == ["cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
                                "cuGraphDestroy", "cuGraphLaunch", "cuGraphLaunch"]
    native = CUDACode(ir.Module(), ".target sm_99", b"", {}, [], {}, "compiled", "", use_disk_cache=False)
    cell = type("Cell", (), {"name": "f", "native": native})()
    with pytest.raises(RanvierError, match="load cell f's PTX: CUDA_ERROR_INVALID_PTX\nptxas fatal: unknown target sm_99"):
        gpu.load(cell)
    assert fake.loaded == b".target sm_99"
    cell.native.cubin = b"\x7fELF machine code from ptxas"  # made at compile time: loaded instead of the PTX
    with pytest.raises(RanvierError, match="load cell f's machine code"):
        gpu.load(cell)
    assert fake.loaded == cell.native.cubin


def _softmax_on_stand_in(monkeypatch, events: list, fail: dict[str, int] | None = None):
    """A two-step cell on the recording stand-in for libcuda (failing the calls in `fail`)."""
    fake = _RecordingDriver(events)
    fake.fail = fail or {}
    gpu = driver.DriverGPU(lambda name: fake)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.softmax(f.var("x", "float32", [4, 8]) * 2.0).var.out = True
    data = rv.Compiler("cuda").compile(flow).cell("f").instance()
    data["f/x"] = random_array([4, 8], "float32", seed=1)
    return data


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_computes_replay_one_graph_or_with_graphs_off_launch_kernel_by_kernel(monkeypatch, graphs):
    """The first compute launches kernel by kernel (cuBLASLt's first calls are no graph's),
    the second captures its launches (thread-local capture mode) and runs the graph, later
    ones replay it. A plain compute's graph holds its kernels alone; a profiled compute
    replays a graph of its own, with a timing mark between each two steps."""
    events: list = []
    data = _softmax_on_stand_in(monkeypatch, events)
    monkeypatch.setenv(resident.GRAPHS_ENVIRONMENT, graphs)
    kernels_per_compute = sum(len(launches) for launches in data.cell.native.kernels.values())
    marks = len(data.cell.steps) + 1
    for profiled in (False, True):
        events.clear()
        if profiled:
            data.reset_profile()
        for _ in range(3):
            data.compute()
        calls = [call for call, _ in events]
        # a timing mark on each side of each step, profiled; while captured, as a node of the graph
        record_flags = [args[2] for call, args in events if call == "cuEventRecordWithFlags"]
        if graphs == "1":
            (capture,) = [args for call, args in events if call == "cuStreamBeginCapture_v2"]
            assert capture[1] == driver._CAPTURE_THREAD_LOCAL == 1
            warm_up = 1 - profiled  # the profiled computes come warm: the first of them is captured
            assert calls.count("cuGraphLaunch") == 3 - warm_up
            assert calls.count("cuLaunchKernel") == (1 + warm_up) * kernels_per_compute  # once captured
            assert calls.index("cuLaunchKernel") < calls.index("cuStreamBeginCapture_v2") or profiled
            assert record_flags == [driver._EVENT_RECORD_EXTERNAL] * marks * profiled
        else:
            assert not any("Capture" in call or "Graph" in call for call in calls)
            assert calls.count("cuLaunchKernel") == 3 * kernels_per_compute
            assert record_flags == [driver._EVENT_RECORD_DEFAULT] * 3 * marks * profiled
        assert ("cuEventElapsedTime" in calls) == profiled


def test_graphs_and_timing_marks_go_back_with_the_instance(monkeypatch):
    """Each instance's two graphs (its plain computes' and its profiled ones') and its
    timing events are destroyed when the instance goes, as its memory is, and not before:
    over 6 instances on the recording stand-in for libcuda, every one made is destroyed."""
    import gc

    events: list = []
    cell = _softmax_on_stand_in(monkeypatch, events).cell

    def made(call: str) -> list[int]:
        return [args[0]._obj.value for name, args in events if name == call]

    def destroyed(call: str) -> list[int]:
        return [args[0].value for name, args in events if name == call]

    for _ in range(6):
        data = cell.instance()
        data["f/x"] = random_array([4, 8], "float32", seed=1)
        for _ in range(2):
            data.compute()
        data.reset_profile()
        for _ in range(2):
            data.compute()
        gc.collect()
    graphs, marks = made("cuGraphInstantiateWithFlags"), made("cuEventCreate")
    assert len(graphs) == 6 * 2 and len(marks) == 6 * (len(cell.steps) + 1)
    assert sorted(destroyed("cuGraphExecDestroy")) == graphs[:-2]  # every instance's but the one alive
    assert sorted(destroyed("cuEventDestroy_v2")) == marks[: -len(cell.steps) - 1]
    del data
    gc.collect()
    assert sorted(destroyed("cuGraphExecDestroy")) == graphs
    assert sorted(destroyed("cuEventDestroy_v2")) == marks


@pytest.mark.parametrize("refused", ["cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags"])
def test_a_graph_the_driver_cannot_capture_leaves_the_instance_launching_kernel_by_kernel(monkeypatch, refused):
    """One warning names the driver's error; that compute and every later one launch their
    kernels one by one, and the capture is not tried again."""
    events: list = []
    data = _softmax_on_stand_in(monkeypatch, events, fail={refused: 900})
    kernels_per_compute = sum(len(launches) for launches in data.cell.native.kernels.values())
    data.compute()
    with pytest.warns(RuntimeWarning, match="cell f: the driver could not capture its launches as a graph .*"
                                            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.*launching them kernel by kernel") as caught:
        for _ in range(3):
            data.compute()
    assert len(caught) == 1
    calls = [call for call, _ in events]
    assert calls.count("cuStreamBeginCapture_v2") == 1 and "cuGraphLaunch" not in calls
    captured = kernels_per_compute if refused != "cuStreamBeginCapture_v2" else 0
    assert calls.count("cuLaunchKernel") == 4 * kernels_per_compute + captured
    assert calls.count("cuStreamEndCapture") == (refused != "cuStreamBeginCapture_v2")  # the stream left capture mode


def test_without_a_gpu_or_the_emulator_an_instance_names_what_is_missing(monkeypatch):
    monkeypatch.delenv(device.DEVICE_ENVIRONMENT, raising=False)
    monkeypatch.setattr(backend, "find_device", lambda: driver.find_device(lambda name: (_ for _ in ()).throw(OSError(name))))
    flow = rv.Flow()
    _classifier(rv.Builder(flow, "f"))
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    with pytest.raises(RanvierError, match="compiled for sm_90, but the CUDA backend needs an NVIDIA GPU"):
        cell.instance()


def _language_model_trainer(backend_name: str, kind: str, matmul: str = "float32", heads: int | None = None):
    """A stories260K-shaped Llama (with `heads` query heads, half as many key/value heads,
    where given), or the MoE preset moe-tiny (with its load-balancing loss), training with
    AdamW and clipping on 2 × 16 tokens, its products in `matmul`."""
    import dataclasses

    from ranvier.models import llama, moe

    config = llama.PRESETS["stories260K"]
    if heads is not None:
        config = dataclasses.replace(config, n_heads=heads, n_kv_heads=heads // 2)
    model = llama.Llama(config, seed=0) if kind == "llama" else moe.MoE(moe.PRESETS["moe-tiny"], seed=0)
    return language_model_trainer(model, backend_name, 2, 16, 1e-3, matmul=matmul), model.config.vocab_size


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_a_language_models_training_step_runs_whole_on_the_device_as_on_the_cpu(on_device, kind):
    """Embedding gather, RMSNorm, rotary embeddings, attention and its
    gradient (blocks of query or key rows streaming tiles, no score matrix), SwiGLU or the experts (router softmax-top-k, the
    routing sort, grouped products and their gradients, the load-balancing loss), the loss,
    every gradient (a scatter-add for the embedding) and AdamW with clipping: every step a
    GPU kernel or a cuBLASLt product, and four steps' losses those of the CPU backend."""
    gpu, vocabulary = _language_model_trainer("cuda", kind)
    kinds = {step.kernel for step in gpu.network.cell("train").steps}
    assert {"cuBLASLt", "Lookup", "Rows", "Scatter", "Copy", "Map", "Reduce", "Attention"} <= kinds, kinds
    if kind == "moe":
        assert {"Route", "GroupedProduct"} <= kinds, kinds
    cpu, _ = _language_model_trainer("cpu", kind)
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = [rng.integers(0, vocabulary, (2, 16)).astype(np.int32) for _ in range(2)]
        assert gpu.step(batch) == pytest.approx(cpu.step(batch), rel=2e-5)


def test_a_bfloat16_training_step_runs_attention_on_tensor_cores_and_follows_the_float32_losses(on_device):
    """With the products in bfloat16 (cuBLASLt's, and attention and its gradient on tensor
    cores; heads of 16 features), ten steps' losses stay within bfloat16's rounding of the
    CPU's float32 ones."""
    gpu, vocabulary = _language_model_trainer("cuda", "llama", matmul="bfloat16", heads=4)
    attention = {step.op.type: step.kernel for step in gpu.network.cell("train").steps if step.op.type.startswith("Attention")}
    assert attention == {"Attention": "AttentionMMA", "AttentionGrad": "AttentionMMA"}
    cpu, _ = _language_model_trainer("cpu", "llama", heads=4)
    rng = np.random.default_rng(1)
    for _ in range(10):
        batch = [rng.integers(0, vocabulary, (2, 16)).astype(np.int32) for _ in range(2)]
        assert gpu.step(batch) == pytest.approx(cpu.step(batch), rel=1e-3)


@pytest.mark.parametrize("preset,batch,steps", [("moe-tiny", 2, 10), pytest.param("moe-15M", 1, 3, marks=pytest.mark.slow)])
def test_a_bfloat16_moe_training_step_runs_its_grouped_products_on_tensor_cores_and_follows_the_float32_losses(
        on_device, preset, batch, steps):
    """moe-tiny, and benchmarks/moe_train.py's moe-15M on a few tokens, with the products
    in bfloat16: the grouped expert products and their gradients on tensor cores (a block
    per tile within a group), and the steps' losses within bfloat16's rounding of the
    CPU's float32 ones."""
    from ranvier.models import moe

    def trainer(backend: str, **options):
        return language_model_trainer(moe.MoE(moe.PRESETS[preset], seed=0), backend, batch, 16, 1e-3, **options)

    gpu = trainer("cuda", matmul="bfloat16")
    grouped = {step.kernel for step in gpu.network.cell("train").steps if step.op.type.startswith("GroupedMatMul")}
    assert grouped == {"GroupedProductMMA"}
    cpu = trainer("cpu")
    rng = np.random.default_rng(2)
    for _ in range(steps):
        batch_ = [rng.integers(0, moe.PRESETS[preset].vocab_size, (batch, 16)).astype(np.int32) for _ in range(2)]
        assert gpu.step(batch_) == pytest.approx(cpu.step(batch_), rel=1e-3)


def _attention_cell(f, dtype: str, size: int = 64):
    """Attention (with its statistics) and the gradient that reads them over [2, 100,
    heads, size] rows, four query heads to two key/value heads, causal: 100 rows, so the
    blocks of 64 (or 32) end ragged."""
    shapes = {"q": [2, 100, 4, size], "k": [2, 100, 2, size], "v": [2, 100, 2, size], "dout": [2, 100, 4, size]}
    q, k, v, dout = (f.var(name, dtype, shape) for name, shape in shapes.items())
    for result in attention_with_gradient(f, q, k, v, dout, heads_first=False):
        result.var.out = True
    return {f"f/{name}": shape for name, shape in shapes.items()}


def _computed_attention(matmul: str, kernel: str, size: int, seed: int, operands: str = "float32"):
    """`_attention_cell` over `operands` compiled with its products in `matmul` (its
    attention `kernel`'s), computed on the device from random operands, the outputs NaN
    first: the operands and the instance."""
    flow = rv.Flow()
    shapes = _attention_cell(rv.Builder(flow, "f"), operands, size)
    cell = rv.Compiler("cuda", matmul=matmul).compile(flow).cell("f")
    assert {step.kernel for step in cell.steps if step.op.type.startswith("Attention")} == {kernel}
    data = cell.instance()
    values = {name: random_array(shape, operands, seed=seed + i) for i, (name, shape) in enumerate(shapes.items())}
    for name, value in values.items():
        data[name] = value
    for name in (var.name for var in flow.vars.values() if var.out):
        data[name] = np.full(data[name].shape, np.nan, data[name].dtype)
    data.compute()
    return values, data


@pytest.mark.parametrize("size", [64, 128])
@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_bfloat16_attention_and_its_gradient_on_the_device_match_float64(on_device, operands, size, monkeypatch):
    """The own tensor-core kernels on the device (the emulator here, the GPU where there
    is one: the one check of the gradient's atomic adds, and of the forward's 68 KB and
    the gradient's 75 KB of dynamic shared memory at heads of 128, in hardware; cuDNN,
    which would claim bfloat16 operands there, told off): the output, its log-sum-exp and dq, dk, dv from them equal
    float64's over the bfloat16-rounded operands, within the rounding of the
    probabilities and score gradients to bfloat16 (and of bfloat16 results)."""
    import ml_dtypes

    from ranvier.backends.cuda import cudnn_attention
    from ranvier.ops.attention import attention, attention_grad

    monkeypatch.setenv(cudnn_attention.ENVIRONMENT, "0")
    values, data = _computed_attention("bfloat16", "AttentionMMA", size, seed=20, operands=operands)
    q, k, v, dout = (values[f"f/{name}"].astype(ml_dtypes.bfloat16).astype(np.float64) for name in ("q", "k", "v", "dout"))
    out, statistics = attention(q, k, v, heads_first=False, statistics=True)
    wants = [out, *attention_grad(q, k, v, out, statistics, dout, heads_first=False)]
    names = ["f/Attention:0", "f/AttentionGrad:0", "f/AttentionGrad:1", "f/AttentionGrad:2"]
    stored = 2.0**-8 if operands == "bfloat16" else 0.0  # a result's own rounding, to the largest element's
    for name, want, share in zip(names, wants, [2.0**-8, 2.0**-7, 2.0**-7, 2.0**-7]):
        scale = np.abs(v).max() if name == "f/Attention:0" else np.abs(want).max()
        np.testing.assert_allclose(np.array(data[name]).astype(np.float64), want, rtol=0, atol=(share + stored) * scale,
                                   err_msg=name)
    np.testing.assert_allclose(np.array(data["f/Attention:1"]), statistics, rtol=2.0**-10, atol=2.0**-10, err_msg="statistics")


@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_bfloat16_grouped_products_on_the_device_match_float64(on_device, operands):
    """A MoE layer's grouped products on tensor cores on the device (the emulator here,
    the GPU where there is one: the one check of their ldmatrix fragments, cp.async
    copies and waits in hardware): y = x · w[e] by groups of 63, 64, 65, 0 and 1 rows with
    rows dropped past the last, and dw[e] = x_eᵀ · dy_e (x's columns as the tile's rows),
    over a depth of 1.5 tiles and rows of whole 16-byte chunks (bfloat16 operands copied
    by cp.async, zeros past the depth); outputs NaN first, equal to float64 over the
    bfloat16-rounded operands within the output's rounding."""
    import ml_dtypes

    from ranvier.ops.moe import grouped_matmul, grouped_matmul_weight_grad

    rows, k, n, offsets = 260, 48, 72, [0, 63, 127, 192, 192, 193]
    experts = len(offsets) - 1
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, dy = f.var("x", operands, [rows, k]), f.var("dy", operands, [rows, n])
    w, groups = f.var("w", operands, [experts, k, n]), f.var("offsets", "int32", [experts + 1])
    f.op("GroupedMatMul", [x, w, groups], None, {"transpose_b": False}).var.out = True
    f.op("GroupedMatMulWeightGrad", [x, dy, groups], None, {"experts": experts, "transpose": False}).var.out = True
    cell = rv.Compiler("cuda", matmul="bfloat16").compile(flow).cell("f")
    assert {step.kernel for step in cell.steps if step.op.type.startswith("Grouped")} == {"GroupedProductMMA"}
    data = cell.instance()
    values = {name: random_array(shape, operands, seed=40 + i)
              for i, (name, shape) in enumerate({"f/x": [rows, k], "f/dy": [rows, n], "f/w": [experts, k, n]}.items())}
    for name, value in {**values, "f/offsets": np.array(offsets, np.int32)}.items():
        data[name] = value
    names = ["f/GroupedMatMul:0", "f/GroupedMatMulWeightGrad:0"]
    for name, shape in zip(names, [[rows, n], [experts, k, n]]):
        data[name] = np.full(shape, np.nan, ml_dtypes.bfloat16 if operands == "bfloat16" else np.float32)
    data.compute()
    rounded = {name: value.astype(ml_dtypes.bfloat16).astype(np.float64) for name, value in values.items()}
    wants = [grouped_matmul(rounded["f/x"], rounded["f/w"], np.array(offsets), False),
             grouped_matmul_weight_grad(rounded["f/x"], rounded["f/dy"], np.array(offsets), experts, False)]
    share = 2.0**-8 if operands == "bfloat16" else 1e-5  # the output's rounding, or float32 sums in another order
    for name, want in zip(names, wants):
        got = np.array(data[name]).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=share, atol=share * np.abs(want).max() / 64, err_msg=name)


@pytest.mark.parametrize("size", [64, 128])
def test_float32_attention_and_its_gradient_on_the_device_match_float64(on_device, size):
    """The float32 kernels (products in float32) on the device, at head sizes whose rows
    are split over two or four lanes of a warp, their dot products summed by shuffles: the
    output, its statistics and dq, dk, dv (from them) equal float64's to float32's rounding."""
    from ranvier.ops.attention import attention, attention_grad

    values, data = _computed_attention("float32", "Attention", size, seed=30)
    q, k, v, dout = (values[f"f/{name}"].astype(np.float64) for name in ("q", "k", "v", "dout"))
    out, statistics = attention(q, k, v, heads_first=False, statistics=True)
    wants = [out, statistics, *attention_grad(q, k, v, out, statistics, dout, heads_first=False)]
    names = ["f/Attention:0", "f/Attention:1", "f/AttentionGrad:0", "f/AttentionGrad:1", "f/AttentionGrad:2"]
    for name, want in zip(names, wants):
        np.testing.assert_allclose(np.array(data[name]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=name)


def test_decoding_with_the_kv_cache_on_the_device_gives_the_cpus_tokens(on_device):
    """The prefill and decode cells share their KV cache on the device (a global each
    writes in place); greedy and sampled tokens equal the CPU backend's."""
    from test_generate import CONFIG, spread_weights

    from ranvier.generate import Generator, Sampling
    from ranvier.models.llama import Llama

    weights = spread_weights()
    prompt = [1, 5, 9, 13, 2, 7, 30, 4, 11, 3]  # longer than the prefill: chunked
    tokens = {}
    for backend_name in ("cuda", "cpu"):
        generator = Generator(Llama(CONFIG), weights, prefill=8, backend=backend_name)
        tokens[backend_name] = (list(generator.stream(prompt, 8, Sampling(temperature=0))),
                                list(generator.stream(prompt, 8, Sampling(temperature=0.9, top_k=20), seed=3)))
    assert tokens["cuda"] == tokens["cpu"]
    assert len(set(tokens["cpu"][0])) > 3


def test_device_memory_goes_back_with_the_instance_and_the_network(monkeypatch):
    import gc

    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    emulator = backend._emulator()
    gc.collect()
    before = len(emulator._memory)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    weights = [f.const(random_array([8, 8], "float32", seed=seed)) for seed in (1, 2)]
    f.tanh(f.var("x", "float32", [3, 8]) @ weights[0] @ weights[1]).var.out = True
    network = rv.Compiler("cuda").compile(flow)
    data = network.cell("f").instance()
    for _ in range(3):  # the second captures a graph (on the emulator, the launches' function)
        data.compute()
    assert len(emulator._memory) == before + 2 + 2  # the arena and the status words; the two constants
    del data
    gc.collect()
    assert len(emulator._memory) == before + 2
    del network
    gc.collect()
    assert len(emulator._memory) == before


def test_device_arrays_share_the_device_memory_without_a_copy(on_device):
    """An output read in place; an input fed on the device (no longer copied in from the
    host, until the host sets it again); a parameter written on the device, which the host
    then reads back."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w = f.var("x", "float32", [4, 6]), f.const(random_array([6, 3], "float32", seed=5))
    y = f.tanh(x @ w)
    y.var.out = True
    network = rv.Compiler("cuda").compile(flow)
    data = network.cell("f").instance()
    values = random_array([4, 6], "float32", seed=6)
    data[x] = values
    data.compute()
    handles = {name: data.device_array(name) for name in (y.name, x.name, w.name)}
    assert repr(handles[y.name]).startswith(f"<DeviceArray {y.name}: float32[4x3] at 0x")
    if on_device == "driver":
        interface = handles[y.name].__cuda_array_interface__
        assert interface["shape"] == (4, 3) and interface["typestr"] == "<f4" and interface["version"] == 3
        return
    np.testing.assert_array_equal(np.asarray(handles[y.name]), data[y])
    np.asarray(handles[x.name])[...] = values * 2  # fed on the device: the host's copy is stale
    np.asarray(handles[w.name])[...] *= -1
    data.compute()
    assert (network[w.name] == -random_array([6, 3], "float32", seed=5)).all()  # the device's value, read back
    expected = np.tanh((values * 2).astype(np.float64) @ network[w.name].astype(np.float64))
    np.testing.assert_allclose(data[y], expected, rtol=1e-5, atol=1e-6)
    data[x] = values  # the host sets it again: copied in as before
    data.compute()
    np.testing.assert_allclose(data[y], np.tanh(values.astype(np.float64) @ network[w.name].astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_on_the_cpu_a_device_array_is_the_instances_own_view():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.tanh(f.var("x", "float32", [2, 3])).var.out = True
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    assert np.shares_memory(data.device_array("f/x"), data["f/x"])


def test_a_bfloat16_variable_has_no_cuda_array_interface_type(monkeypatch):
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.neg(f.var("x", "bfloat16", [2, 3])).var.out = True
    data = rv.Compiler("cuda").compile(flow).cell("f").instance()
    with pytest.raises(RanvierError, match="f/x is bfloat16, which __cuda_array_interface__ has no type string for"):
        data.device_array("f/x")


def test_an_unrolled_trainer_on_the_device_takes_the_cpus_steps(on_device):
    """Four optimizer steps inside one compute (the parameters' updates chained on the device)."""
    from test_train import MLP, Adam, X, Y, softmax_cross_entropy

    from ranvier.train.unrolled import UnrolledTrainer

    results = {}
    for backend_name in ("cuda", "cpu"):
        flow = rv.Flow()
        model = MLP([7, 16, 3], seed=3)

        def build(b, params, k, model=model):
            x, y = b.var(f"x{k}", rv.DT_FLOAT, [16, 7]), b.var(f"labels{k}", rv.DT_INT32, [16])
            return softmax_cross_entropy(model(b, x, params), y)

        params = list(model.parameters(rv.Builder(flow, "train_unrolled")).values())
        trainer = UnrolledTrainer(flow, build, params, 4, Adam(lr=0.01), backend=backend_name)
        trainer.set_dataset([X, Y.argmax(axis=1).astype(np.int32)], seed=5)
        losses = [loss for call in trainer.train(2, progress=False) for loss in call]
        results[backend_name] = losses, np.array(trainer.network["mlp/W0"])
    np.testing.assert_allclose(results["cuda"][0], results["cpu"][0], rtol=2e-6)
    np.testing.assert_allclose(results["cuda"][1], results["cpu"][1], rtol=1e-5, atol=1e-6)
