"""Every `ranvier` subcommand given bad input says what was wrong in one line on stderr,
without a traceback: exit code 2 for usage errors, 1 for failures; --debug and
RANVIER_DEBUG show the traceback. No training here: the run directories are fakes with
the config.json that real runs write."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from ranvier.cli import _describe, build_parser, console
from ranvier.compiler import compiler
from ranvier.errors import RanvierError
from ranvier.jobs import rundir
from ranvier.jobs.mnist import MnistConfig
from ranvier.train import runs as run_files
from ranvier.train.runs import LlamaRunConfig


def fake_run(path: Path, kind: str, config, recorded: bool = True) -> Path:
    """A run directory as training leaves it (config, metrics, a checkpoint folder), without weights.
    recorded=False: config.json as runs wrote it before it named the run's kind."""
    path.mkdir(parents=True)
    rundir.write_config(path, kind, config)
    if not recorded:
        saved = (path / "config.json").read_text().replace(f'"kind": "{kind}",', "")
        (path / "config.json").write_text(saved)
    (path / "checkpoint").mkdir()
    (path / "metrics.jsonl").write_text('{"step": 10, "loss": 2.3, "lr": 0.001}\n')
    return path


@pytest.fixture
def runs(tmp_path):
    return {
        "mnist": fake_run(tmp_path / "mnist", "mnist", MnistConfig()),
        "llama": fake_run(tmp_path / "llama", "llama", LlamaRunConfig()),
        "moe": fake_run(tmp_path / "moe", "moe", LlamaRunConfig(preset="moe-tiny", model="moe")),
        "old-mnist": fake_run(tmp_path / "old-mnist", "mnist", MnistConfig(), recorded=False),
        "old-llama": fake_run(tmp_path / "old-llama", "llama", LlamaRunConfig(), recorded=False),
        "huge-mnist": fake_run(tmp_path / "huge-mnist", "mnist", MnistConfig(hidden=[10**12])),
    }


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run `ranvier ARGS...` in this process: (exit code, stderr). Compiles stay
    unannounced however slow the machine is: stderr holds the error line alone."""
    monkeypatch.delenv("RANVIER_DEBUG", raising=False)
    monkeypatch.setattr("ranvier.cli.COMPILE_STATUS_AFTER", 1e9)

    def run(*argv: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["ranvier", *map(str, argv)])
        try:
            code = console()
        except SystemExit as exit:  # argparse's usage errors
            code = exit.code
        return code, capsys.readouterr().err

    return run


def assert_one_line(code: int, err: str, expected_code: int, *words: str) -> None:
    assert code == expected_code, err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err


def subcommands(parser) -> set[str]:
    """Every leaf command, as "train mnist", "export hf", "demo"."""
    found = set()
    for action in parser._subparsers._group_actions:
        for name, child in action.choices.items():
            found |= {f"{name} {leaf}" for leaf in subcommands(child)} if child._subparsers else {name}
    return found


# (arguments, words the line must hold); {mnist}, {llama}, {moe}, {missing} are run directories.
USAGE = [
    ([], ["required: command"]),
    (["nonsense"], ["invalid choice"]),
    (["demo", "--seed", "x"], ["--seed", "invalid int value"]),
    (["demo", "--cpu=-avx9000"], ["avx9000"]),
    (["train"], ["required: task"]),
    (["train", "mnist", "--steps", "0"], ["--steps", "positive"]),
    (["train", "mnist", "--steps", "-5"], ["--steps"]),
    (["train", "mnist", "--batch", "0"], ["--batch"]),
    (["train", "mnist", "--lr", "0"], ["--lr"]),
    (["train", "mnist", "--lr", "-0.1"], ["--lr"]),
    (["train", "mnist", "--checkpoint-every", "0"], ["--checkpoint-every"]),
    (["train", "mnist", "--cpu=-avx9000"], ["unknown CPU feature 'avx9000'"]),
    (["train", "mnist", "--model", "rnn"], ["--model"]),
    (["train", "onnx", "m.onnx", "--steps", "0"], ["--steps", "positive"]),
    (["train", "onnx", "m.onnx", "--weight-decay", "-1"], ["--weight-decay"]),
    (["train", "llama", "--minutes", "0"], ["--minutes"]),
    (["train", "llama", "--minutes", "-1"], ["--minutes"]),
    (["train", "llama", "--steps", "0"], ["--steps"]),
    (["train", "llama", "--seq", "0"], ["--seq"]),
    (["train", "llama", "--accumulate", "0"], ["--accumulate"]),
    (["train", "moe", "--batch", "-1"], ["--batch"]),
    (["train", "moe", "--cpu=-avx9000"], ["avx9000"]),
    (["generate"], ["model"]),
    (["generate", "{llama}", "--top-p", "1.5"], ["--top-p"]),
    (["generate", "{llama}", "--temperature", "-1"], ["--temperature"]),
    (["generate", "{llama}", "--max-tokens", "0"], ["--max-tokens"]),
    (["generate", "{llama}", "--backend", "tpu"], ["--backend"]),
    (["summary"], ["--preset"]),
    (["summary", "--preset", "stories15M", "--seq", "0"], ["--seq"]),
    (["plot"], ["run_dir"]),
    (["eval"], ["run_dir"]),
    (["eval", "{mnist}", "--bogus"], ["--bogus"]),
    (["data"], ["dataset"]),
    (["data", "pretokenize"], ["--out"]),
    (["data", "pretokenize", "--out", "x", "--vocab-size", "0"], ["--vocab-size"]),
    (["data", "tinystories", "--vocab-size", "0"], ["--vocab-size"]),
    (["export"], ["format"]),
    (["export", "hf", "{llama}"], ["out_dir"]),
    (["export", "llama2c", "{llama}", "out.bin", "--version", "2"], ["--version"]),
    (["export", "gguf", "{llama}", "out.gguf", "--dtype", "q4_0"], ["--dtype"]),
    (["generate", "{llama}", "--weights", "int4"], ["--weights"]),
    (["train", "mnist", "--matmul", "int8"], ["--matmul"]),
    (["convert", "model.onnx"], ["target"]),
    (["run"], ["model"]),
    (["run", "model.onnx", "--cpu=-avx9000"], ["avx9000"]),
    (["bench", "model.onnx", "--repeats", "0"], ["--repeats"]),
    (["cache"], ["action"]),
    (["cache", "wipe"], ["invalid choice"]),
]

FAILURES = [
    (["generate", "{missing}"], ["is not a run directory, a llama2.c checkpoint, a GGUF file or a Hugging Face folder"]),
    (["generate", "{llama}", "--weights", "int8", "--matmul", "bfloat16"], ["ask for two precisions: give one"]),
    (["generate", "{file}"], ["llama2.c checkpoint", "--tokenizer"]),
    (["generate", "{mnist}"], ["is an MNIST run; `ranvier generate` needs a llama or moe run"]),
    (["generate", "{old-mnist}"], ["is an MNIST run"]),
    (["summary", "--preset", "stories1B"], ["unknown preset 'stories1B'"]),
    (["train", "mnist", "--resume", "{missing}"], ["is not a run directory"]),
    (["train", "mnist", "--resume", "{llama}"], ["is a llama run; `ranvier train mnist --resume` needs an MNIST run"]),
    (["train", "mnist", "--resume", "{old-llama}"], ["is a llama run"]),
    (["train", "llama", "--resume", "{mnist}"], ["is an MNIST run; `ranvier train llama --resume` needs a llama run"]),
    (["train", "llama", "--resume", "{moe}"], ["is a moe run"]),
    (["train", "moe", "--resume", "{llama}"], ["`ranvier train moe --resume` needs a moe run"]),
    (["train", "onnx", "--resume", "{mnist}"], ["is an MNIST run; `ranvier train onnx --resume` needs an ONNX run"]),
    (["train", "onnx"], ["takes a model to start a run (ranvier train onnx MODEL.onnx) or --resume RUN_DIR"]),
    (["train", "onnx", "{missing}", "--run-dir", "{new}", "--quiet"], ["missing does not exist"]),
    (["train", "onnx", "{file}", "--run-dir", "{new}", "--quiet"], ["is not a valid ONNX model"]),
    (["train", "mnist", "--data", "{missing}", "--run-dir", "{new}", "--quiet"], ["not found"]),
    (["train", "llama", "--corpus", "{missing}", "--run-dir", "{new}", "--quiet"], ["does not exist"]),
    (["eval", "{missing}"], ["is not a run directory"]),
    (["eval", "{file}"], ["is not a run directory"]),
    (["eval", "{empty}"], ["config.json is missing"]),
    (["eval", "{llama}"], ["is a llama run; `ranvier eval` needs an MNIST run"]),
    (["eval", "{old-llama}"], ["is a llama run"]),
    (["eval", "{mnist}"], ["no checkpoint"]),
    (["eval", "{huge-mnist}"], ["layer sizes [784, 1000000000000, 10]): 2.82 PiB, past ranvier's memory limit"]),
    (["plot", "{missing}"], ["is not a run directory"]),
    (["export", "hf", "{mnist}", "{new}"], ["is an MNIST run; `ranvier export hf` needs a llama or moe run"]),
    (["export", "llama2c", "{mnist}", "out.bin"], ["is an MNIST run"]),
    (["export", "llama2c", "{moe}", "out.bin"], ["is a moe run; `ranvier export llama2c` needs a llama run"]),
    (["export", "hf", "{missing}", "{new}"], ["is not a run directory"]),
    (["export", "gguf", "{mnist}", "out.gguf"], ["is an MNIST run; `ranvier export gguf` needs a llama run"]),
    (["export", "gguf", "{moe}", "out.gguf"], ["is a moe run; `ranvier export gguf` needs a llama run"]),
    (["data", "pretokenize", "{missing}", "--out", "{new}"], ["does not exist"]),
    (["data", "pretokenize", "--out", "{file}"], ["exists already and is not a folder"]),
    (["data", "tinystories", "--json-dir", "{missing}", "--dest", "{new}"], ["not found"]),
    (["convert", "{missing}.onnx", "{new}.flow"], ["no model file"]),
    (["convert", "{flow}", "{new}.txt"], ["the formats are .flow and .onnx"]),
    (["run", "{missing}.flow"], ["no model file"]),
    (["run", "{flow}", "--input", "f/x={missing}.npy"], ["cannot read input f/x"]),
    (["run", "{flow}", "--input", "f/x={npy}", "--output", "{file}"], ["exists already and is not a folder"]),
    (["bench", "{missing}.onnx"], ["no model file"]),
    (["plot", "{not-utf8-metrics}"], ["metrics.jsonl line 2 is not JSON", "can't decode byte 0xff"]),
    (["train", "mnist", "--resume", "{zero-batch}"], ["config.json: batch is 0, expected an integer above 0"]),
    (["train", "llama", "--resume", "{odd-shards}", "--steps", "5", "--quiet"],
     ['config.json: shards holds {"file": "data00.bin"}, expected a token shard\'s {"path": string']),
    (["run", "{flow}", "--input", "f/x={records}"], ["f/x from", "holds elements of dtype [('a', '<f4')], expected real numbers"]),
]


@pytest.fixture
def paths(tmp_path, runs):
    import ranvier as rv

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.relu(f.var("x", rv.DT_FLOAT, [1, 4]), name="y")
    flow.save(tmp_path / "model.flow")
    np.save(tmp_path / "x.npy", np.ones((1, 4), np.float32))
    (tmp_path / "model.bin").write_bytes(b"not a model")
    (tmp_path / "empty").mkdir()
    np.save(tmp_path / "records.npy", np.zeros((1, 4), [("a", "f4")]))
    metrics = fake_run(tmp_path / "not-utf8-metrics", "mnist", MnistConfig())
    (metrics / "metrics.jsonl").write_bytes(b'{"step": 10, "loss": 2.3}\n{"step": 20, "loss": 2.\xff}\n')
    odd_shards = fake_run(tmp_path / "odd-shards", "llama", LlamaRunConfig(shards=[{"file": "data00.bin"}]))
    named = {"missing": tmp_path / "missing", "new": tmp_path / "new", "file": tmp_path / "model.bin",
             "empty": tmp_path / "empty", "flow": tmp_path / "model.flow", "npy": tmp_path / "x.npy",
             "records": tmp_path / "records.npy", "not-utf8-metrics": metrics,
             "zero-batch": fake_run(tmp_path / "zero-batch", "mnist", MnistConfig(batch=0)), "odd-shards": odd_shards}
    return {**named, **runs}


def fill(argv: list[str], paths: dict) -> list[str]:
    return [arg.format(**paths) for arg in argv]


def test_the_cases_cover_every_subcommand():
    tried = {" ".join(argv[:2]) if argv[:1] in (["train"], ["data"], ["export"]) else argv[0]
             for argv, _ in USAGE + FAILURES if argv and argv[0] != "nonsense"}
    assert subcommands(build_parser()) <= tried


@pytest.mark.parametrize("argv, words", USAGE, ids=[" ".join(a) or "(nothing)" for a, _ in USAGE])
def test_usage_errors_say_one_line_and_exit_2(cli, paths, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    code, err = cli(*fill(argv, paths))
    assert_one_line(code, err, 2, *words)
    assert not (tmp_path / "runs").exists()  # refused before any work


@pytest.mark.parametrize("argv, words", FAILURES, ids=[" ".join(a) for a, _ in FAILURES])
def test_failures_say_one_line_and_exit_1(cli, paths, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    code, err = cli(*fill(argv, paths))
    assert_one_line(code, err, 1, "ranvier: error: ", *words)


def test_the_cuda_backend_without_a_gpu_compiles_then_names_the_missing_driver(cli, paths, tmp_path, monkeypatch):
    from ranvier.backends.cuda import backend, device, driver

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.delenv(device.DEVICE_ENVIRONMENT, raising=False)
    monkeypatch.setattr(backend, "find_device", lambda: driver.find_device(missing))
    monkeypatch.chdir(tmp_path)
    code, err = cli(*fill(["train", "mnist", "--backend", "cuda", "--steps", "1", "--run-dir", "{new}", "--quiet"], paths))
    assert_one_line(code, err, 1, "ranvier: error: ", "libcuda.so.1 could not be loaded", "use --backend cpu")


def test_plot_without_matplotlib_says_which_extra(cli, runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    code, err = cli("plot", runs["mnist"])
    assert_one_line(code, err, 1, "pip install 'ranvier[plot]'")


def test_convert_without_onnx_says_which_extra(cli, paths, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)
    for name in [name for name in sys.modules if name == "ranvier.onnx" or name.startswith("ranvier.onnx.")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, and failing, by the command
    code, err = cli("convert", paths["flow"], tmp_path / "model.onnx")
    assert_one_line(code, err, 1, "this command needs the onnx package: pip install 'ranvier[onnx]'")


@pytest.mark.parametrize("error, words", [
    (FileNotFoundError(2, "No such file or directory", "a/b"), "a/b does not exist"),
    (NotADirectoryError(20, "Not a directory", "a/b"), "a/b is not a folder"),
    (IsADirectoryError(21, "Is a directory", "a"), "a is a folder, where a file is needed"),
    (PermissionError(13, "Permission denied", "a"), "a cannot be used: permission denied"),
    (OSError(28, "No space left on device", "a/c.o"), "cannot write a/c.o: No space left on device (ENOSPC)"),
    (OSError(30, "Read-only file system", "a"), "cannot write a: Read-only file system (EROFS)"),
    (ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib.pyplot"), "pip install 'ranvier[plot]'"),
    (ModuleNotFoundError("No module named 'sentencepiece'", name="sentencepiece"), "pip install sentencepiece"),
])
def test_file_errors_and_missing_packages_are_described(error, words):
    assert words in _describe(error)


@pytest.mark.parametrize("number, one_line", [(28, True), (30, True), (104, False)])  # ENOSPC, EROFS; ECONNRESET
def test_a_machine_failing_a_write_is_one_line_other_os_errors_a_traceback(cli, monkeypatch, number, one_line):
    def failing():
        raise OSError(number, "failed", "/cache/x.o")

    monkeypatch.setattr("ranvier.backends.compile_cache.describe_cache", failing)
    if not one_line:
        with pytest.raises(OSError):
            cli("cache", "info")
        return
    code, err = cli("cache", "info")
    assert_one_line(code, err, 1, "cannot write /cache/x.o: failed (E")


def test_debug_flag_and_environment_show_the_traceback(cli, runs, monkeypatch):
    with pytest.raises(RanvierError, match="is a llama run"):
        cli("--debug", "eval", runs["llama"])
    monkeypatch.setenv("RANVIER_DEBUG", "1")
    with pytest.raises(RanvierError, match="is a llama run"):
        cli("eval", runs["llama"])


def test_the_installed_command_prints_one_line_or_with_debug_the_traceback(runs):
    command = [sys.executable, "-m", "ranvier.cli"]
    plain = subprocess.run([*command, "eval", str(runs["llama"])], capture_output=True, text=True, check=False)
    assert_one_line(plain.returncode, plain.stderr, 1, "`ranvier eval` needs an MNIST run")
    debug = subprocess.run([*command, "--debug", "eval", str(runs["llama"])], capture_output=True, text=True, check=False)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "RanvierError: " in debug.stderr


def test_run_kinds_are_recorded_and_inferred_for_older_runs(runs):
    for name, kind in [("mnist", "mnist"), ("llama", "llama"), ("moe", "moe"), ("old-mnist", "mnist"), ("old-llama", "llama")]:
        assert run_files.kind_of(run_files.check_kind(runs[name], (kind,))) == kind
    assert run_files.kind_of({"architectures": ["LlamaForCausalLM"]}) is None  # a Hugging Face config
    assert run_files.read_config(runs["old-mnist"], MnistConfig, ("mnist",)) == MnistConfig()


def test_a_slow_compile_says_so_on_stderr_and_the_library_stays_quiet(capsys):
    import time

    import ranvier as rv
    from ranvier.cli import _CompileStatus

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.relu(f.var("x", rv.DT_FLOAT, [1, 4]), name="y")
    rv.Compiler().compile(flow)
    assert capsys.readouterr().err == ""  # no observer outside the command
    status = _CompileStatus(flow)
    status.timer.interval = 0.01
    with status:
        time.sleep(0.2)
    assert capsys.readouterr().err.startswith("compiling f (1 ops)… 0.")


def _recording(seen: list):
    """A compile observer that notes each compile's functions as it starts and ends."""

    @contextlib.contextmanager
    def observer(flow):
        seen.append(("start", list(flow.funcs)))
        yield
        seen.append("end")

    return observer


def test_compiles_are_observed_only_within_an_observing_block():
    import ranvier as rv

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.relu(f.var("x", rv.DT_FLOAT, [1, 4]), name="y")
    seen: list = []
    rv.Compiler().compile(flow)
    with compiler.observing(_recording(seen)):
        rv.Compiler().compile(flow)
        with compiler.observing(None):  # a rank that does not print, within the command
            rv.Compiler().compile(flow)
    rv.Compiler().compile(flow)
    assert seen == [("start", ["f"]), "end"]


@pytest.mark.parametrize("root", [True, False])
def test_the_command_shows_its_compiles_on_rank_0_alone(monkeypatch, capsys, root):
    seen: list = []
    monkeypatch.setattr("ranvier.cli._CompileStatus", _recording(seen))
    if not root:
        monkeypatch.setattr("ranvier.cli._world", lambda: types.SimpleNamespace(is_root=False, rank=1, size=2))
    monkeypatch.setattr(sys, "argv", ["ranvier", "demo"])
    assert console() == 0
    assert seen == ([("start", ["f"]), "end"] if root else [])


def test_a_new_run_that_fails_before_its_first_checkpoint_leaves_no_directory(tmp_path):
    from ranvier.cli import main

    run_dir = tmp_path / "run"
    with pytest.raises(RanvierError):
        main(["train", "llama", "--data", str(tmp_path / "nowhere"), "--run-dir", str(run_dir), "--quiet"])
    assert not run_dir.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RanvierError):
        main(["train", "llama", "--data", str(tmp_path / "nowhere"), "--run-dir", str(kept), "--quiet"])
    assert kept.exists()  # a folder the user made stays
