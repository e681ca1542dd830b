"""The `ranvier` command."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import debug
from .atomic import os_error
from .backends import MATMUL_PRECISIONS, PRECISIONS, WEIGHT_PRECISIONS, backend_names
from .errors import RanvierError
from .interop.gguf_file import GGUF_TYPES

_MATMUL_HELP = ("bfloat16: mixed-precision matrix products (bf16 inputs, float32 sums) on AMX-BF16 CPUs or GPUs, attention "
                "too on GPUs (tensor cores); tfloat32: TF32 inputs on GPUs")
_INFERENCE_MATMUL_HELP = ("bfloat16: products by the weights with these rounded to bf16, float32 sums: on any CPU the "
                          "weights are kept in bf16 panels, half the bytes to read (a decoded token's products only "
                          "read them), on AMX-BF16 CPUs the products with rows run on tiles; int8 (CPU): the weights "
                          "kept as llama.cpp's q8_0 blocks (32 int8, a float16 scale), the products' rows quantized "
                          "likewise, int32 sums; tfloat32: TF32 inputs on GPUs")
_TRAINING_MATMUL = tuple(p for p in MATMUL_PRECISIONS if p not in WEIGHT_PRECISIONS)  # a step has no constant matrices
_PRECISION_HELP = ("bfloat16 / float16: activations and their gradients stored in that type on GPUs (parameters and "
                   "optimizer state float32; float16 with dynamic loss scaling")


def _number(kind: type, accepts, needs: str):
    """An argparse type: a number of `kind` that `accepts`, or a usage error saying it `needs` more."""

    def parse(text: str):
        value = kind(text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{text} is not {needs}")
        return value

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


_positive_int = _number(int, lambda n: n > 0, "a positive integer")
_positive_float = _number(float, lambda x: x > 0, "above 0")
_non_negative_float = _number(float, lambda x: x >= 0, "0 or more")
_probability = _number(float, lambda x: 0 < x <= 1, "in (0, 1]")


def _check_run(path: str, kinds: tuple[str, ...], command: str) -> None:
    """A command taking a run directory says up front when it is of the wrong kind."""
    from .train.runs import check_kind

    check_kind(Path(path), kinds, f"`ranvier {command}`")


def _demo(args: argparse.Namespace) -> int:
    """Build Myelin's example cell y = softmax(relu(x W + b)), print its layout and run it."""
    import ranvier as myelin

    rng = np.random.default_rng(args.seed)
    flow = myelin.Flow()
    f = myelin.Builder(flow, "f")
    W = f.array("W", rng.random((64, 256), dtype=np.float32))
    b = f.array("b", rng.random(256, dtype=np.float32))
    x = f.var("x", myelin.DT_FLOAT, [1, 64])
    y = f.softmax(f.relu(f.add(f.matmul(x, W), b)), name="y")
    net = myelin.Compiler(backend=args.backend, cpu=args.cpu).compile(flow)
    cell = net.cell("f")
    print(cell)
    data = cell.instance()
    data[x] = 5.0
    data.compute()
    result = np.asarray(data[y])
    print(f"argmax={int(result.argmax())} max={float(result.max()):.6f} sum={float(result.sum()):.6f}")
    return 0


class _Noted(argparse.Action):
    """argparse's store action that also notes the option in `args.given`: a resumed run
    must tell a flag the user gave from one left at its default."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = {*namespace.given, self.dest}


class _NotedSwitch(_Noted):
    """store_true, noted."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=True, default=default, required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, self.const, option_string)


def _noting_given(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make the parser's options (added after this) note in `args.given` which were given."""
    parser.register("action", None, _Noted)
    parser.register("action", "store", _Noted)
    parser.register("action", "store_true", _NotedSwitch)
    parser.set_defaults(given=frozenset())
    return parser


def _given(args: argparse.Namespace) -> dict:
    """The options given on the command line, by name, with their values."""
    return {name: getattr(args, name) for name in args.given}


def _join_the_ranks(args: argparse.Namespace) -> None:
    """In one of several data-parallel ranks: stop with the `--workers` launcher that
    started it, and, if not rank 0 (which alone prints, shows progress and writes the run),
    be quiet."""
    from .distributed import current_world
    from .distributed.launch import launcher_pid, watch_launcher

    world = current_world()
    if world.size > 1 and args.workers not in (1, world.size):
        raise RanvierError(f"--workers {args.workers} in an MPI job of {world.size} ranks: leave --workers out under mpiexec")
    launcher = launcher_pid()
    if launcher is not None:
        def orphaned() -> None:
            print(f"ranvier: error{_rank()}: the launcher (process {launcher}) has ended; this rank stops too",
                  file=sys.stderr, flush=True)
            os._exit(1)

        watch_launcher(launcher, orphaned)
    if not world.is_root:  # its compiles go unannounced too (`console`)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- this rank's output, for the rest of the process
        args.quiet, args.dashboard = True, False


def _launch_workers(args: argparse.Namespace, run_dir: Path) -> int:
    """Run this command as --workers N ranks, in `run_dir` (named to them: a new run's
    default name is this process's to choose), and wait for them."""
    from .distributed.launch import launch

    argv = args.argv if args.resume or args.run_dir else [*args.argv, "--run-dir", str(run_dir)]
    code = launch(argv, args.workers)
    if code:
        raise RanvierError(f"the {args.workers} workers stopped with exit code {code}: a rank failed or was killed "
                           "(its message is above); the last checkpoint is intact")
    return 0


def _train(args: argparse.Namespace, kinds: tuple[str, ...], new_name: str,
           start: Callable[[Path], object], resume: Callable[[Path], object]) -> int:
    """A training command: `start` a new run in --run-dir (else runs/<new_name>, a strftime
    pattern), or `resume` the one --resume names, holding its run directory claimed (see
    jobs.rundir.claimed) for the run's life; with --workers N, in the launcher of N ranks."""
    from .distributed import launched_by_mpi
    from .distributed.launch import launcher_pid
    from .jobs.rundir import claimed

    launching = args.workers > 1 and not launched_by_mpi()
    if launched_by_mpi():
        _join_the_ranks(args)
    if args.resume:
        _check_run(args.resume, kinds, f"train {args.task} --resume")
        run_dir = Path(args.resume)
    else:
        run_dir = Path(args.run_dir or Path("runs") / time.strftime(new_name))
        if launcher_pid() is None:  # a launcher's ranks are told it, and the launcher has said it
            print(f"run directory: {run_dir}")
    with claimed(run_dir, resume=bool(args.resume), force=args.force):
        if launching:
            return _launch_workers(args, run_dir)
        (resume if args.resume else start)(run_dir)
    return 0


def _train_mnist(args: argparse.Namespace) -> int:
    from .jobs.mnist import MnistConfig, resume_mnist, train_mnist

    def start(run_dir: Path) -> None:
        config = MnistConfig(
            model=args.model,
            steps=args.steps if args.steps is not None or args.minutes is not None else MnistConfig.steps,
            minutes=args.minutes,
            batch=args.batch,
            lr=args.lr,
            optimizer=args.optimizer,
            backend=args.backend,
            cpu=args.cpu,
            matmul=args.matmul,
            precision=args.precision,
            seed=args.seed,
            data=args.data,
            checkpoint_every=args.checkpoint_every,
            zero=args.zero,
        )
        train_mnist(config, run_dir, progress=not args.quiet, profile=args.profile, dashboard=args.dashboard)

    def resume(run_dir: Path) -> None:
        resume_mnist(run_dir, _given(args), progress=not args.quiet, profile=args.profile, dashboard=args.dashboard)

    return _train(args, ("mnist",), f"mnist-{args.model}-%Y%m%d-%H%M%S", start, resume)


def _train_llama(args: argparse.Namespace) -> int:
    from .jobs.llama import resume_llama, train_llama
    from .train.runs import LlamaRunConfig

    def start(run_dir: Path) -> None:
        config = LlamaRunConfig(
            preset=args.preset, model=args.task, corpus=args.corpus, data=args.data,
            steps=args.steps if args.steps is not None or args.minutes is not None else LlamaRunConfig.steps, minutes=args.minutes,
            batch=args.batch, seq=args.seq, lr=args.lr, accumulate=args.accumulate, seed=args.seed,
            backend=args.backend, cpu=args.cpu, max_corpus_bytes=args.max_corpus_bytes, checkpointed=args.checkpointed,
            matmul=args.matmul, precision=args.precision, checkpoint_every=args.checkpoint_every, zero=args.zero,
        )
        train_llama(config, run_dir, progress=not args.quiet, dashboard=args.dashboard)

    def resume(run_dir: Path) -> None:
        resume_llama(run_dir, _given(args), progress=not args.quiet, dashboard=args.dashboard)

    return _train(args, (args.task,), f"{args.task}-{args.preset}-%Y%m%d-%H%M%S", start, resume)


def _load_language_model(model: str, tokenizer: str | None, kinds: tuple[str, ...], command: str):
    """(config, weights, tokenizer) of a run directory (of one of `kinds`), a llama2.c .bin,
    a GGUF file or a Hugging Face folder."""
    from .interop import load_any
    from .train.runs import kind_of, read_saved

    config_file = Path(model, "config.json")
    if config_file.is_file() and kind_of(read_saved(config_file)):  # a run, not a Hugging Face folder
        _check_run(model, kinds, command)
    return load_any(Path(model), tokenizer)


def _train_onnx(args: argparse.Namespace) -> int:
    from .jobs.onnx import OnnxRunConfig, resume_onnx, train_onnx

    if (args.model is None) == (args.resume is None):
        raise RanvierError("ranvier train onnx takes a model to start a run (ranvier train onnx MODEL.onnx) "
                           "or --resume RUN_DIR to continue one, not both")

    def start(run_dir: Path) -> None:
        config = OnnxRunConfig(
            model=str(Path(args.model).resolve()), data=str(Path(args.data).resolve()) if args.data else None,
            steps=args.steps if args.steps is not None or args.minutes is not None else OnnxRunConfig.steps,
            minutes=args.minutes, batch=args.batch, seq=args.seq, lr=args.lr, weight_decay=args.weight_decay,
            optimizer=args.optimizer, seed=args.seed, backend=args.backend, cpu=args.cpu, matmul=args.matmul,
            checkpoint_every=args.checkpoint_every, zero=args.zero,
        )
        train_onnx(config, run_dir, progress=not args.quiet, dashboard=args.dashboard)

    def resume(run_dir: Path) -> None:
        resume_onnx(run_dir, _given(args), progress=not args.quiet, dashboard=args.dashboard)

    return _train(args, ("onnx",), f"onnx-{Path(args.model or 'model').stem}-%Y%m%d-%H%M%S", start, resume)


def _generate(args: argparse.Namespace) -> int:
    from .generate import Generator, Sampling
    from .models import language_model

    if args.weights is not None and args.matmul not in ("float32", args.weights):
        raise RanvierError(f"--weights {args.weights} and --matmul {args.matmul} ask for two precisions: give one")
    config, weights, tokenizer = _load_language_model(args.model, args.tokenizer, ("llama", "moe"), "generate")
    matmul = args.weights if args.weights is not None else args.matmul
    generator = Generator(language_model(config), weights, backend=args.backend, matmul=matmul)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompt = tokenizer.encode(args.prompt, bos=True)
    print(args.prompt, end="", flush=True)
    produced, text, start = [], "", time.perf_counter()
    for token in generator.stream(prompt, args.max_tokens, sampling, seed=args.seed, eos=tokenizer.eos_id):
        produced.append(token)
        decoded = tokenizer.decode(produced)
        print(decoded[len(text):], end="", flush=True)  # stream only what is new
        text = decoded
    seconds = time.perf_counter() - start
    print()
    # Statistics go to stderr, so that stdout holds the text alone.
    print(f"{len(produced)} tokens, {len(produced) / max(seconds, 1e-9):.1f} tokens/s", file=sys.stderr)
    return 0


def _summary(args: argparse.Namespace) -> int:
    from .models.summary import find_preset, summary

    try:
        find_preset(args.preset)
    except KeyError as error:
        raise RanvierError(error.args[0]) from None
    print(summary(args.preset, args.seq))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .plot import plot_run

    _check_run(args.run_dir, ("mnist", "llama", "moe"), "plot")
    print(plot_run(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .jobs.mnist import evaluate_run

    _check_run(args.run_dir, ("mnist",), "eval")
    evaluate_run(Path(args.run_dir))
    return 0


def _data_tinystories(args: argparse.Namespace) -> int:
    """Download TinyStories (unless --json-dir), get a tokenizer, pretokenize into DEST/tok<VOCAB>/."""
    from pathlib import Path

    from .data.tinystories import download_tinystories, pretokenize_tinystories, train_tinystories_vocab
    from .data.tokenizers import load_tokenizer

    dest = Path(args.dest)
    json_dir = Path(args.json_dir) if args.json_dir else download_tinystories(dest)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        print(f"training a {args.vocab_size}-piece SentencePiece vocabulary on {json_dir}")
        tokenizer = train_tinystories_vocab(json_dir, args.vocab_size, dest / f"tok{args.vocab_size}")
    out = dest / f"tok{tokenizer.vocab_size}"
    manifest = pretokenize_tinystories(json_dir, tokenizer, out,
                                       on_shard=lambda path, n: print(f"wrote {path} ({n:,} tokens)"))
    print(f"{manifest['tokens']:,} tokens from {manifest['documents']:,} stories in {out}, "
          f"vocabulary {tokenizer.vocab_size}, unigram entropy {manifest['unigram_entropy']:.4f} nats/token")
    return 0


def _data_pretokenize(args: argparse.Namespace) -> int:
    """Tokenize a text corpus (default: the standard library's source) into uint16 shards in --out."""
    from pathlib import Path

    from .data.corpus import iter_documents
    from .data.shards import pretokenize
    from .data.tokenizers import ByteTokenizer, load_tokenizer, train_sentencepiece

    out = Path(args.out)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    elif args.vocab_size:
        print(f"training a {args.vocab_size}-piece SentencePiece vocabulary on {args.path or 'the standard library'}")
        tokenizer = train_sentencepiece(iter_documents(args.path, args.max_bytes), args.vocab_size, "bpe", out / "tokenizer")
    else:
        tokenizer = ByteTokenizer()
    manifest = pretokenize(iter_documents(args.path, args.max_bytes), tokenizer, out,
                           on_shard=lambda path, n: print(f"wrote {path} ({n:,} tokens)"))
    print(f"{manifest['tokens']:,} tokens from {manifest['documents']:,} documents in {out}, "
          f"vocabulary {tokenizer.vocab_size}, unigram entropy {manifest['unigram_entropy']:.4f} nats/token")
    return 0


def _export_llama2c(args: argparse.Namespace) -> int:
    """Write a run's checkpoint as a llama2.c model file (and its tokenizer as tokenizer.bin)."""
    from pathlib import Path

    from .data.tokenizers import load_tokenizer
    from .interop import export_llama2c, export_tokenizer_bin, weights_from_run

    _check_run(args.run_dir, ("llama",), "export llama2c")
    config, weights = weights_from_run(Path(args.run_dir))
    path = export_llama2c(config, weights, Path(args.out), version=args.version)
    print(f"wrote {path} (llama2.c version {args.version}, {config.parameter_count() / 1e6:.2f}M parameters)")
    if args.tokenizer_out:
        tokenizer_path = export_tokenizer_bin(load_tokenizer(Path(args.run_dir) / "tokenizer.model"), Path(args.tokenizer_out))
        print(f"wrote {tokenizer_path}")
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    """Write a model (a run, llama2.c checkpoint, Hugging Face folder or GGUF file) as a GGUF file llama.cpp loads."""
    from .interop import export_gguf

    config, weights, tokenizer = _load_language_model(args.model, args.tokenizer, ("llama",), "export gguf")
    path = export_gguf(config, weights, tokenizer, Path(args.out), args.dtype)
    print(f"wrote {path} (GGUF, llama, matrices in {args.dtype}, {config.parameter_count() / 1e6:.2f}M parameters)")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    """Write a run's checkpoint as a Hugging Face folder (LlamaForCausalLM, or MixtralForCausalLM for a
    MoE), plus tokenizer.model."""
    from pathlib import Path

    from .atomic import atomic_write_bytes
    from .interop import export_hf, weights_from_run

    _check_run(args.run_dir, ("llama", "moe"), "export hf")
    run_dir, out = Path(args.run_dir), Path(args.out_dir)
    config, weights = weights_from_run(run_dir)
    export_hf(config, weights, out)
    atomic_write_bytes(out / "tokenizer.model", (run_dir / "tokenizer.model").read_bytes())
    print(f"wrote {out}/config.json, model.safetensors and tokenizer.model ({config.parameter_count() / 1e6:.2f}M parameters)")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .modelrun import convert, only_function, parse_dims

    flow = convert(args.source, args.target, parse_dims(args.dims))
    func = only_function(flow) if len(flow.funcs) == 1 else None
    ops = len(func.ops) if func else sum(len(f.ops) for f in flow.funcs.values())
    print(f"wrote {args.target}: {len(flow.funcs)} function(s), {ops} ops, {len(flow.vars)} variables")
    return 0


def _run_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .modelrun import load_model, parse_dims, read_inputs, run

    flow = load_model(args.model, parse_dims(args.dims))
    data, outputs = run(flow, read_inputs(flow, args.input), args.backend, args.cpu, args.matmul)
    for name, array in outputs.items():
        print(f"{name}: {array.dtype}[{'x'.join(map(str, array.shape))}]")
        print(np.array2string(array, threshold=20, edgeitems=3, precision=6))
        if args.output:
            Path(args.output).mkdir(parents=True, exist_ok=True)
            np.save(Path(args.output) / f"{name.replace('/', '_')}.npy", array)
    if args.profile:
        data.reset_profile()
        data.compute()
        print(data.profile(), file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .modelrun import bench, comparison, load_model, parse_dims

    flow = load_model(args.model, parse_dims(args.dims))
    times = bench(args.model, flow, args.repeats, args.cpu, args.matmul)
    ours, theirs = times["ranvier"], times["onnxruntime"]
    products = f" (products in {args.matmul})" if args.matmul != "float32" else ""
    print(f"{args.model}: ranvier{products} {ours * 1e3:.2f} ms, ONNX Runtime {theirs * 1e3:.2f} ms "
          f"(medians of {args.repeats}): {comparison('ranvier', ours, 'ONNX Runtime', theirs, higher_is_better=False)}")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from .backends import compile_cache

    if args.action == "clear":
        count, size = compile_cache.clear_cache()
        print(f"deleted {count:,} entries ({size / 2**20:,.1f} MB) from {compile_cache.cache_dir()}")
    else:
        print(compile_cache.describe_cache())
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors said in one line (exit code 2); subcommands' parsers
    are of the same class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ranvier", description="Neural-network JIT compiler and trainer.")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error (also: RANVIER_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="build, print and run Myelin's example cell")
    demo.add_argument("--backend", default="cpu", choices=backend_names())
    demo.add_argument("--cpu", default="", metavar="MASK", help="CPU features to mask, e.g. -avx512")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    demo.set_defaults(run=_demo)

    train = commands.add_parser("train", help="train a model")
    minutes_help = ("train for about this many minutes: the step time, measured over a few warm-up steps, "
                    "fixes the step count (and the learning-rate schedule to it)")
    resume_help = ("continue a run from its checkpoint; --steps, --minutes and --checkpoint-every may change, "
                   "the run's other settings may not")
    tasks = train.add_subparsers(dest="task", required=True)
    mnist = _noting_given(tasks.add_parser("mnist", help="an MNIST classifier (bundled 5,000-digit subset by default)"))
    mnist.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    mnist.add_argument("--steps", type=_positive_int, default=None, help="total optimizer steps (default 2340; with --minutes, at most this many)")
    mnist.add_argument("--minutes", type=_positive_float, default=None, help=minutes_help)
    mnist.add_argument("--batch", type=_positive_int, default=128, help="examples per step, over all workers (default: %(default)s)")
    mnist.add_argument("--lr", type=_positive_float, default=1e-3, help="learning rate, constant (default: %(default)s)")
    mnist.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam")
    mnist.add_argument("--backend", default="cpu", choices=backend_names())
    mnist.add_argument("--cpu", default="", metavar="MASK", help="CPU features to mask, e.g. -avx512 or -avx512,-avx2")
    mnist.add_argument("--matmul", default="float32", choices=_TRAINING_MATMUL,
                       help=_MATMUL_HELP)
    mnist.add_argument("--precision", default="float32", choices=PRECISIONS,
                       help=_PRECISION_HELP + ")")
    mnist.add_argument("--profile", action="store_true", help="print the train step's per-kernel profile at the end")
    mnist.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batch order (default: %(default)s)")
    mnist.add_argument("--data", default=None, help="folder with the four MNIST IDX files (plain or .gz)")
    _run_options(mnist, resume_help)
    _data_parallel_options(mnist)
    mnist.set_defaults(run=_train_mnist)

    from .models import LANGUAGE_MODELS

    kinds = {"llama": "a Llama", "moe": "a mixture-of-experts"}
    for task, (presets, _) in LANGUAGE_MODELS.items():
        lm = _noting_given(tasks.add_parser(
            task, help=f"{kinds[task]} language model on a text corpus (the standard library by default)"))
        names = list(presets)
        lm.add_argument("--preset", default=names[0], help=f"{', '.join(names[:-1])} or {names[-1]}")
        source = lm.add_mutually_exclusive_group()
        source.add_argument("--corpus", default=None, help="a text file or folder (default: the Python standard library's source)")
        source.add_argument("--data", default=None, metavar="SHARDS",
                            help="a folder of token shards from `ranvier data pretokenize` or `ranvier data tinystories`, "
                                 "trained on with their tokenizer; the run refers to them, so keep them in place")
        lm.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default 2000; with --minutes, at most this many)")
        lm.add_argument("--minutes", type=_positive_float, default=None, help=minutes_help)
        lm.add_argument("--batch", type=_positive_int, default=16, help="sequences per micro-batch, over all workers (default: %(default)s)")
        lm.add_argument("--seq", type=_positive_int, default=128, help="tokens per sequence (default: %(default)s)")
        lm.add_argument("--lr", type=_positive_float, default=2e-3, help="peak learning rate, after warm-up, of the cosine schedule (default: %(default)s)")
        lm.add_argument("--accumulate", type=_positive_int, default=1,
                        help="micro-batches whose gradients are summed into one optimizer step (default: %(default)s)")
        lm.add_argument("--checkpointed", action="store_true",
                        help="stream the layers through one compiled layer forward and backward (CheckpointedStack): "
                             "compile time and activation memory independent of depth")
        lm.add_argument("--max-corpus-bytes", type=_positive_int, default=None)
        lm.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batch order (default: %(default)s)")
        lm.add_argument("--backend", default="cpu", choices=backend_names())
        lm.add_argument("--cpu", default="", metavar="MASK")
        lm.add_argument("--matmul", default="float32", choices=_TRAINING_MATMUL,
                        help=_MATMUL_HELP)
        lm.add_argument("--precision", default="float32", choices=PRECISIONS,
                        help=_PRECISION_HELP + "; not with --checkpointed)")
        _run_options(lm, resume_help, dashboard="a live terminal dashboard with samples")
        _data_parallel_options(lm)
        lm.set_defaults(run=_train_llama)

    from_onnx = tasks.add_parser("onnx", help="an ONNX model: a classifier on MNIST, or a language model on token shards")
    from_onnx.add_argument("model", nargs="?", default=None, help="the .onnx file (its weights are where training starts)")
    from_onnx = _noting_given(from_onnx)
    from_onnx.add_argument("--data", default=None,
                      help="a folder of token shards (`ranvier data pretokenize`): a language model; else MNIST's IDX files "
                           "(default: the bundled 5,000-digit subset): a classifier")
    from_onnx.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default 1000; with --minutes, at most this many)")
    from_onnx.add_argument("--minutes", type=_positive_float, default=None, help=minutes_help)
    from_onnx.add_argument("--batch", type=_positive_int, default=32, help="examples per step, over all workers (default: %(default)s)")
    from_onnx.add_argument("--seq", type=_positive_int, default=128, help="a language model's tokens per window (default: %(default)s)")
    from_onnx.add_argument("--lr", type=_positive_float, default=1e-3, help="learning rate, constant (default: %(default)s)")
    from_onnx.add_argument("--weight-decay", type=_non_negative_float, default=0.01, help="(default: %(default)s)")
    from_onnx.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], default="adamw")
    from_onnx.add_argument("--seed", type=int, default=0, help="seed of the batch order and the dropout masks (default: %(default)s)")
    from_onnx.add_argument("--backend", default="cpu", choices=backend_names())
    from_onnx.add_argument("--cpu", default="", metavar="MASK", help="CPU features to mask, e.g. -avx512")
    from_onnx.add_argument("--matmul", default="float32", choices=MATMUL_PRECISIONS, help=_MATMUL_HELP)
    _run_options(from_onnx, resume_help, written="config, metrics, checkpoints and trained.onnx")
    _data_parallel_options(from_onnx)
    from_onnx.set_defaults(run=_train_onnx)

    generate = commands.add_parser("generate", help="generate text from a trained Llama run directory")
    generate.add_argument("model", help="a `ranvier train llama|moe` run directory, a llama2.c .bin or a Hugging Face folder")
    generate.add_argument("--tokenizer", default=None, help="tokenizer.bin (llama2.c) or a tokenizer file")
    generate.add_argument("--prompt", default="")
    generate.add_argument("--temperature", type=_non_negative_float, default=0.8, help="0 means greedy")
    generate.add_argument("--top-k", type=_positive_int, default=None)
    generate.add_argument("--top-p", type=_probability, default=None)
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    generate.add_argument("--max-tokens", type=_positive_int, default=256)
    generate.add_argument("--backend", default="cpu", choices=backend_names())
    generate.add_argument("--matmul", default="float32", choices=MATMUL_PRECISIONS, help=_INFERENCE_MATMUL_HELP)
    generate.add_argument("--weights", default=None, choices=["float32", "bfloat16", "int8"],
                          help="how the products keep the weights: bfloat16 (bf16 panels) or int8 (q8_0 blocks), "
                               "--matmul's names for the same")
    generate.set_defaults(run=_generate)

    overview = commands.add_parser("summary", help="a language-model preset's parameters, FLOPs and memory, without its weights")
    overview.add_argument("--preset", required=True, help="e.g. moe-5.9B, moe-15M or stories110M")
    overview.add_argument("--seq", type=_positive_int, default=None, help="sequence length for the FLOP count (default: the preset's)")
    overview.set_defaults(run=_summary)

    plot = commands.add_parser("plot", help="write a run's loss and learning-rate curves as a PNG")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/curves.png)")
    plot.set_defaults(run=_plot)

    evaluate = commands.add_parser("eval", help="re-evaluate a run directory's checkpoint")
    evaluate.add_argument("run_dir")
    evaluate.set_defaults(run=_eval)

    data = commands.add_parser("data", help="prepare language-model training data (uint16 token shards)")
    datasets = data.add_subparsers(dest="dataset", required=True)
    stories = datasets.add_parser("tinystories", help="download TinyStories, train a vocabulary, pretokenize")
    stories.add_argument("--dest", default="data/tinystories", help="where the archive, vocabulary and shards go")
    stories.add_argument("--json-dir", default=None, help="already unpacked JSON shards: skip the download")
    stories_vocab = stories.add_mutually_exclusive_group()
    stories_vocab.add_argument("--vocab-size", type=_positive_int, default=4096, metavar="N",
                               help="train a SentencePiece vocabulary of N pieces (default 4096)")
    stories_vocab.add_argument("--tokenizer", default=None, metavar="FILE", help="use this tokenizer (.model or .json)")
    stories.set_defaults(run=_data_tinystories)
    corpus = datasets.add_parser("pretokenize", help="pretokenize a text file or folder (default: the standard library)")
    corpus.add_argument("path", nargs="?", default=None, help="text file or folder (*.txt, *.md, *.rst, *.py)")
    corpus.add_argument("--out", required=True, metavar="DIR", help="folder for the shards, tokenizer and manifest")
    corpus.add_argument("--max-bytes", type=_positive_int, default=None, metavar="N", help="read at most this much text")
    corpus_vocab = corpus.add_mutually_exclusive_group()
    corpus_vocab.add_argument("--tokenizer", default=None, metavar="FILE", help="use this tokenizer (.model or .json)")
    corpus_vocab.add_argument("--vocab-size", type=_positive_int, default=None, metavar="N",
                              help="train a SentencePiece vocabulary of N pieces on the corpus")
    corpus_vocab.add_argument("--bytes", action="store_true", help="byte tokens, 258-id vocabulary (the default)")
    corpus.set_defaults(run=_data_pretokenize)

    export = commands.add_parser("export", help="export a Llama run's checkpoint for llama2.c, llama.cpp (GGUF) or Hugging Face")
    formats = export.add_subparsers(dest="format", required=True)
    llama2c = formats.add_parser("llama2c", help="a llama2.c model .bin (run.c reads version 0)")
    llama2c.add_argument("run_dir", help="a `ranvier train llama` run directory")
    llama2c.add_argument("out", help="the .bin file to write")
    llama2c.add_argument("--version", type=int, choices=[0, 1], default=0, help="0: legacy (run.c), 1: export.py's version 1")
    llama2c.add_argument("--tokenizer-out", default=None, metavar="FILE", help="also write the tokenizer as llama2.c's tokenizer.bin")
    llama2c.set_defaults(run=_export_llama2c)
    gguf = formats.add_parser("gguf", help="a GGUF file llama.cpp loads (llama architecture, SentencePiece vocabulary)")
    gguf.add_argument("model", help="a `ranvier train llama` run directory, a llama2.c .bin, a Hugging Face folder or a GGUF file")
    gguf.add_argument("out", help="the .gguf file to write")
    gguf.add_argument("--tokenizer", default=None, help="the model's tokenizer.bin (llama2.c) or tokenizer file, where it has none")
    gguf.add_argument("--dtype", default="float32", choices=GGUF_TYPES,
                      help="the matrices' type: q8_0 is blocks of 32 int8 with a float16 scale (default: %(default)s)")
    gguf.set_defaults(run=_export_gguf)
    hf = formats.add_parser("hf", help="a Hugging Face folder (config.json, model.safetensors): LlamaForCausalLM, or MixtralForCausalLM for a MoE")
    hf.add_argument("run_dir", help="a `ranvier train llama|moe` run directory")
    hf.add_argument("out_dir", help="the folder to write")
    hf.set_defaults(run=_export_hf)

    dims_help = "sizes of the model's symbolic dimensions, e.g. batch=1,seq=128 (a .flow file's -1: batch=N)"
    conversion = commands.add_parser("convert", help="convert a model file: .onnx or .flow to .flow or .onnx")
    conversion.add_argument("source", help="model.onnx or model.flow")
    conversion.add_argument("target", help="model.flow or model.onnx to write")
    conversion.add_argument("--dims", help=dims_help)
    conversion.set_defaults(run=_convert)

    running = commands.add_parser("run", help="run a .flow or .onnx model on inputs from .npy files and print its outputs")
    running.add_argument("model", help="model.flow or model.onnx")
    running.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="one per model input")
    running.add_argument("--dims", help=dims_help)
    running.add_argument("--backend", default="cpu", choices=backend_names())
    running.add_argument("--cpu", default="", metavar="MASK", help="CPU features to mask, e.g. -avx512")
    running.add_argument("--matmul", default="float32", choices=MATMUL_PRECISIONS, help=_INFERENCE_MATMUL_HELP)
    running.add_argument("--output", metavar="DIR", help="also save each output as DIR/NAME.npy")
    running.add_argument("--profile", action="store_true", help="print the per-step profile (to stderr)")
    running.set_defaults(run=_run_model)

    benchmark = commands.add_parser("bench", help="time an .onnx model in ranvier and in ONNX Runtime on the same random inputs")
    benchmark.add_argument("model", help="model.onnx")
    benchmark.add_argument("--dims", help=dims_help)
    benchmark.add_argument("--repeats", type=_positive_int, default=10, help="timed runs per side (default 10; medians are compared)")
    benchmark.add_argument("--cpu", default="", metavar="MASK", help="CPU features to mask, e.g. -avx512")
    benchmark.add_argument("--matmul", default="float32", choices=MATMUL_PRECISIONS, help=_INFERENCE_MATMUL_HELP)
    benchmark.set_defaults(run=_bench)

    cache = commands.add_parser("cache", help="the JIT cache of compiled code ($RANVIER_CACHE, default ~/.cache/ranvier)")
    cache.add_argument("action", choices=["info", "clear"], help="info: where, entries, size; clear: delete every entry")
    cache.set_defaults(run=_cache)
    return parser


def _run_options(parser: argparse.ArgumentParser, resume_help: str, written: str = "config, metrics and checkpoints",
                 dashboard: str = "a live terminal dashboard") -> None:
    """A training job's run directory and how it shows progress. A run directory that holds a
    run already is continued (--resume) or replaced (--force)."""
    parser.add_argument("--run-dir", default=None, help=f"where to write {written}")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument("--resume", default=None, metavar="RUN_DIR", help=resume_help)
    existing.add_argument("--force", action="store_true",
                          help="start over in a --run-dir that holds a run, deleting that run (without --force or "
                               "--resume such a folder is refused)")
    parser.add_argument("--checkpoint-every", type=_positive_int, default=500, help="steps between checkpoints (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--dashboard", action="store_true", help=f"{dashboard} (plain output when not a terminal)")


def _data_parallel_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                        help="train data-parallel in N processes on this machine through mpiexec (pip install 'ranvier[mpi]'); "
                             "--batch is split over them. Across machines: mpiexec -n N -f HOSTFILE ranvier train ... "
                             "(default: %(default)s)")
    parser.add_argument("--zero", action="store_true",
                        help="with several workers, shard the optimizer state over them (ZeRO-1)")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with what argparse cannot check refused as a usage error too."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what --workers relaunches in each rank
    if getattr(args, "cpu", ""):
        from .backends.cpu.target import host_target

        try:  # before any work: a run directory, a vocabulary, a compile
            host_target(args.cpu)
        except RanvierError as error:
            parser.exit(2, f"ranvier: error: argument --cpu: {error}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run a command; ranvier's errors propagate (for callers and tests)."""
    args = _parse(argv)
    return args.run(args)


# Errors a user makes and can fix: said in one line instead of a traceback.
USER_ERRORS = (RanvierError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
               ModuleNotFoundError)
# What the machine, not ranvier, got wrong while writing (the compile cache, a corpus being
# tokenized): one line too. Other OSErrors keep their traceback.
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}
# Optional packages and the extra that installs each.
EXTRAS = {"matplotlib": "plot", "onnx": "onnx", "mpi4py": "mpi"}


def _describe(error: Exception) -> str:
    """One line saying what was wrong and what to do."""
    if isinstance(error, ModuleNotFoundError):
        package = (error.name or "").split(".")[0]
        install = f"'ranvier[{EXTRAS[package]}]'" if package in EXTRAS else package
        return f"this command needs the {package} package: pip install {install}"
    if isinstance(error, OSError) and error.filename:
        what = {
            FileNotFoundError: "does not exist",
            FileExistsError: "exists already and is not a folder",
            NotADirectoryError: "is not a folder (or a folder in its path is a file)",
            IsADirectoryError: "is a folder, where a file is needed",
            PermissionError: "cannot be used: permission denied",
        }
        if type(error) in what:
            return f"{error.filename} {what[type(error)]}"
        return f"cannot write {error.filename}: {os_error(error)}"
    return str(error)


def _world():
    """The data-parallel world of a process mpiexec (or --workers) started, else None."""
    from .distributed import current_world, launched_by_mpi

    return current_world() if launched_by_mpi() else None


def _rank() -> str:
    """" (rank 1 of 4)" in a data-parallel rank, else ""."""
    world = _world()
    return f" (rank {world.rank} of {world.size})" if world is not None and world.size > 1 else ""


def _end_other_ranks(code: int) -> None:
    """A data-parallel rank that stops ends the whole job: the others would wait for it."""
    world = _world()
    if world is not None and world.size > 1:
        world.abort(code)


COMPILE_STATUS_AFTER = 1.0  # seconds a compile runs before it is announced


class _CompileStatus:
    """A compile still running after a second says so on stderr, and ends the line with
    how long it took: a cold llama run compiles for seconds without a word otherwise."""

    def __init__(self, flow):
        ops = sum(len(func.ops) for func in flow.funcs.values())
        names = list(flow.funcs)
        self.what = f"{', '.join(names[:3])}{' and more' if len(names) > 3 else ''} ({ops:,} ops)"
        self.timer = threading.Timer(COMPILE_STATUS_AFTER, self._announce)
        self.timer.daemon = True
        self.announced = False

    def _announce(self) -> None:
        self.announced = True
        print(f"compiling {self.what}…", end="", file=sys.stderr, flush=True)

    def __enter__(self) -> None:
        self.start = time.perf_counter()
        self.timer.start()

    def __exit__(self, failed, *_) -> None:
        self.timer.cancel()
        self.timer.join()  # an announcement under way is printed before the result
        if self.announced:
            print(f" {time.perf_counter() - self.start:.1f} s" if failed is None else "", file=sys.stderr, flush=True)


def console() -> int:
    """The `ranvier` command: a user's error said in one line (exit code 1; usage errors 2),
    the full traceback with --debug or RANVIER_DEBUG."""
    from .compiler.compiler import observing

    args = _parse(sys.argv[1:])
    # Names a file held as bytes that are not UTF-8 (read as surrogates) print escaped, as on stderr.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    show_traceback = args.debug or debug.tracebacks()
    try:
        world = _world()
        with observing(_CompileStatus if world is None or world.is_root else None):  # rank 0 alone prints
            return args.run(args)
    except (*USER_ERRORS, OSError) as error:
        ours = isinstance(error, ModuleNotFoundError) and (error.name or "").startswith("ranvier")  # a bug, not the user's
        unexpected = not isinstance(error, USER_ERRORS) and error.errno not in ENVIRONMENT_ERRNOS
        if show_traceback or ours or unexpected:
            raise
        print(f"ranvier: error{_rank()}: {_describe(error)}", file=sys.stderr)
        _end_other_ranks(1)
        return 1
    except KeyboardInterrupt:
        if show_traceback:
            raise
        print(f"ranvier: interrupted{_rank()}", file=sys.stderr)
        _end_other_ranks(130)
        return 130


if __name__ == "__main__":
    sys.exit(console())
