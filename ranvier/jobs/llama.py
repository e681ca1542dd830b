"""`ranvier train llama|moe`: train a Llama or a mixture-of-experts language model on a
text corpus in a run directory.

The corpus (any text file or folder; by default the Python standard library's own
source, which every user has) is tokenized with a SentencePiece vocabulary trained
for the preset's vocabulary size, written as llama2.c token shards, and split into
training and validation tokens. Training samples random windows; the whole step —
forward, backward, AdamW with warmup + cosine and clipping — is one compiled cell.

The shards are not copied into the run: a text corpus is tokenized once into the cache
(`corpora/` beside the compiled code, reused by every run on the same text and vocabulary
size), shards from `ranvier data pretokenize` are trained on where they are, and
config.json records the shard files with their sizes and times, which a resume checks.
A run directory holds config.json, its tokenizer (tokenizer.model, or tokenizer.json for
byte tokens), metrics.jsonl and checkpoint/ (weights, optimizer state, sampler RNG state).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from ..dashboard import training_display
from ..data import corpus as corpora
from ..data.shards import MANIFEST, TokenShards, pretokenize
from ..data.tokenizers import load_tokenizer, train_sentencepiece
from ..distributed import current_world
from ..errors import RanvierError, brief
from ..flow.builder import Builder
from ..flow.graph import Flow
from ..models import MoE, language_model
from ..models.llama import Llama
from ..train.budget import plan_steps
from ..train.checkpoint import METADATA, CheckpointError
from ..train.losses import softmax_cross_entropy
from ..train.optimizers import AdamW
from ..train.options import TrainOptions
from ..train.runs import LlamaRunConfig, family_of, model_config_for, read_run, run_tokenizer
from ..train.schedules import WarmupCosine
from ..train.stack import CheckpointedStack
from ..train.trainer import Trainer
from . import rundir
from .peak import measured_peak


@dataclass
class LlamaRun:
    trainer: Trainer | CheckpointedStack
    model: Llama
    train: TokenShards
    validation: TokenShards
    eval_loss: Callable[[np.ndarray, np.ndarray], float]  # (tokens, targets) → loss, forward only
    unigram_entropy: float


def tokenized_corpus(config: LlamaRunConfig, vocab_size: int) -> Path:
    """The folder of the corpus's shards and vocabulary in the cache, made on first use.

    Its name hashes what the tokens depend on (the corpus files with their sizes and
    times, the byte cap, the vocabulary size), so an edited corpus is tokenized afresh."""
    from ..backends.cache_folder import cache_dir

    files = corpora.corpus_files(config.corpus)
    identity = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    key = hashlib.sha256(json.dumps([identity, config.max_corpus_bytes, vocab_size]).encode()).hexdigest()[:16]
    folder = cache_dir() / "corpora" / f"{Path(config.corpus or 'stdlib').name}-{vocab_size}-{key}"
    if (folder / MANIFEST).exists():
        print(f"corpus: tokenized in {folder} by an earlier run")
        return folder
    documents = list(corpora.iter_documents(config.corpus, config.max_corpus_bytes))
    if not documents:
        raise RanvierError(f"the corpus {config.corpus or 'standard library'} has no text")
    print(f"corpus: {len(documents)} documents, {sum(map(len, documents)) / 1e6:.1f} MB; training a {vocab_size}-piece vocabulary")
    # Built beside and renamed into place, so a run never sees half a folder (and of two
    # runs tokenizing the same corpus at once, the first to finish wins).
    partial = folder.with_name(f".{folder.name}.{os.getpid()}")
    remove_abandoned(folder)
    shutil.rmtree(partial, ignore_errors=True)
    train_sentencepiece(iter(documents), vocab_size, output_prefix=partial / "tokenizer", character_coverage=0.9999)
    pretokenize(documents, load_tokenizer(partial / "tokenizer.model"), partial)
    try:
        os.replace(partial, folder)
    except OSError:
        shutil.rmtree(partial)
    print(f"corpus: tokenized into {folder} (later runs on the same corpus reuse it)")
    return folder


def remove_abandoned(folder: Path) -> None:
    """Delete the half-built `.<folder>.<pid>` copies that killed processes left (a live
    process's build is its own to finish)."""
    for partial in folder.parent.glob(f".{glob.escape(folder.name)}.*"):
        pid = partial.suffix[1:]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except PermissionError:  # another user's process, alive
            pass


def shard_record(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def check_shards(run_dir: Path, recorded: list[dict]) -> None:
    """Refuse to resume on shards that are gone or differ from those the run started on."""
    if not recorded:
        raise RanvierError(f"{run_dir / 'config.json'}: shards is [], expected the token shards the run trains on")
    for entry in recorded:
        if set(entry) != {"path", "bytes", "mtime_ns"} or not isinstance(entry["path"], str) or \
                type(entry["bytes"]) is not int or type(entry["mtime_ns"]) is not int:
            raise RanvierError(f"{run_dir / 'config.json'}: shards holds {brief(entry)}, expected a token shard's "
                               '{"path": string, "bytes": integer, "mtime_ns": integer}')
        path = Path(entry["path"])
        if not path.is_file():
            raise RanvierError(f"{run_dir} trains on the token shard {path}, which is missing; "
                               "put it back to resume (or start a new run)")
        if shard_record(path) != entry:
            raise RanvierError(f"the token shard {path} has changed since {run_dir} started (its size or modification "
                               "time differs); resuming on other tokens would not continue the run: restore it, or start a new run")


def prepare_data(config: LlamaRunConfig, run_dir: Path, vocab_size: int) -> tuple[Path, dict, list[Path]]:
    """(tokenizer, manifest, shard files): on a fresh run, the --data folder's or the
    tokenized corpus's, its tokenizer copied into the run and its shards recorded in the
    config; on resume, those the config records, checked to be unchanged."""
    if config.shards is not None:
        check_shards(run_dir, config.shards)
        paths = [Path(entry["path"]) for entry in config.shards]
        return run_tokenizer(run_dir), json.loads((paths[0].parent / MANIFEST).read_text()), paths
    legacy = run_dir / "data"  # runs made before shards were referenced hold their own
    folder = Path(config.data) if config.data else legacy if (legacy / MANIFEST).exists() else tokenized_corpus(config, vocab_size)
    if config.data and not (folder / MANIFEST).is_file():
        raise RanvierError(f"{folder} is not a folder of token shards from `ranvier data pretokenize` "
                           f"(no {MANIFEST}, which names their tokenizer)")
    shards = TokenShards(folder)
    manifest = shards.manifest
    source = folder / manifest["tokenizer"]["file"]
    tokenizer_path = run_dir / source.name
    atomic_write_bytes(tokenizer_path, source.read_bytes())
    if config.data:
        shards.validate(load_tokenizer(tokenizer_path).vocab_size)
    paths = [Path(name) for name in shards.names]
    config.shards = [shard_record(path) for path in paths]
    return tokenizer_path, manifest, paths


def lr_schedule(config: LlamaRunConfig) -> WarmupCosine:
    """Warmup, then cosine decay to min_lr at the run's last step (before --minutes has
    planned the steps, to the warmup's end: the warm-up steps that measure the rate run
    inside the warmup, whatever the plan)."""
    return WarmupCosine(lr=config.lr, warmup=config.warmup, total=config.steps or config.warmup, floor=config.min_lr)


def build(config: LlamaRunConfig, run_dir: Path) -> LlamaRun:
    presets, model_class = family_of(config)
    if config.preset not in presets:
        raise RanvierError(f"unknown {model_class.__name__} preset {config.preset!r}; choose one of {', '.join(presets)}")
    preset = presets[config.preset]
    # Rank 0 of a data-parallel run tokenizes the corpus; the others then find it in the cache.
    world = current_world()
    if not world.is_root:
        world.barrier("waiting for rank 0 to prepare the training data")
    tokenizer_path, manifest, paths = prepare_data(config, run_dir, preset.vocab_size)
    if world.is_root:
        world.barrier("waiting for every rank to start")
    tokenizer = load_tokenizer(tokenizer_path)
    model_config = model_config_for(config, tokenizer.vocab_size)
    train, validation = TokenShards(paths).split(fraction=0.05)
    model = language_model(model_config, seed=config.seed)
    world.rows(config.batch)  # --batch is the global micro-batch: each rank's cells take their share
    batch = config.batch // world.size
    rows = batch * config.seq

    def lm_loss(b: Builder, logits, targets, name: str | None = None):
        return softmax_cross_entropy(logits.reshape([rows, model_config.vocab_size]), targets.reshape([rows]), name=name)

    optimizer = AdamW(lr=config.lr, beta1=0.9, beta2=0.95, weight_decay=config.weight_decay, decay_matrices_only=True)
    schedule = lr_schedule(config)
    options = TrainOptions(schedule=schedule, clip_norm=config.clip, accumulate=config.accumulate, precision=config.precision,
                           backend=config.backend, cpu=config.cpu, matmul=rundir.requested_matmul(config), zero=config.zero)
    entropy = float(manifest.get("unigram_entropy", math.nan))
    if config.checkpointed:
        if config.precision != "float32":
            raise RanvierError(f"--precision {config.precision} stores a whole step's activations in one cell; "
                               "it does not combine with --checkpointed")
        window = ("int32", [batch, config.seq])
        stack = CheckpointedStack(model, window, window, lm_loss, optimizer, options)
        return LlamaRun(stack, model, train, validation, stack.loss, entropy)

    flow = Flow()
    f = Builder(flow, "train")
    f.func.training = True
    tokens = f.var("tokens", "int32", [batch, config.seq])
    targets = f.var("targets", "int32", [batch, config.seq])
    params = model.parameters(f)
    loss = lm_loss(f, model(f, tokens, params), targets, name="loss")
    # A MoE's load-balancing (and z-) losses join the loss; its expert loads are reported.
    watch = {f"load.{i}": counts for i, counts in enumerate(model.expert_loads(f))}
    aux = model.auxiliary_loss(f)
    if aux is not None:
        loss = loss + aux
        watch["aux_loss"] = aux

    e = Builder(flow, "eval")
    eval_tokens = e.var("tokens", "int32", [batch, config.seq])
    eval_targets = e.var("targets", "int32", [batch, config.seq])
    eval_loss = lm_loss(e, model(e, eval_tokens), eval_targets, name="loss")
    eval_loss.var.out = True

    trainer = Trainer(loss, list(params.values()), optimizer, options, inputs=[tokens, targets], watch=watch)
    eval_data = trainer.network.cell("eval").instance()

    def evaluate(x: np.ndarray, y: np.ndarray) -> float:
        eval_data[eval_tokens], eval_data[eval_targets] = x, y
        eval_data.compute()
        return float(eval_data[eval_loss])

    return LlamaRun(trainer, model, train, validation, evaluate, entropy)


def expert_metrics(watched: dict[str, np.ndarray]) -> dict:
    """A MoE step's auxiliary loss and expert loads: each expert's share of the routed
    tokens (averaged over layers) and the worst layer's max/mean load (1 is balanced)."""
    loads = [watched[name] for name in sorted(watched) if name.startswith("load.")]
    if not loads:
        return {}
    shares = [load / max(load.sum(), 1.0) for load in loads]
    record = {
        "expert_load": [round(float(s), 4) for s in np.mean(shares, axis=0)],
        "load_max_mean": round(max(float(load.max() / max(load.mean(), 1e-9)) for load in loads), 4),
    }
    if "aux_loss" in watched:
        record["aux_loss"] = float(watched["aux_loss"])
    return record


def validation_loss(run: LlamaRun, config: LlamaRunConfig) -> float:
    """Mean loss over the same fixed validation windows every time (split over the ranks of a
    data-parallel run, which average their means)."""
    world = run.trainer.world
    rng = np.random.default_rng(12345)
    losses = []
    for _ in range(config.eval_batches):
        x, y = run.validation.sample(config.batch, config.seq, rng, rows=world.rows(config.batch))
        losses.append(run.eval_loss(x, y))
    mean = np.array([np.mean(losses)])
    world.sum_(mean, "the all-reduce of the validation loss")
    return float(mean[0]) / world.size


def restore_sampler_rng(rng: np.random.Generator, state: object, source: Path) -> None:
    """Give `rng` (numpy's PCG64) the batch sampler's `state` saved in `source`: two 128-bit
    words and a buffered 32-bit one, or an error naming the field."""
    words = state.get("state") if isinstance(state, dict) else None
    if not (isinstance(words, dict) and all(type(words.get(name)) is int and 0 <= words[name] < 2**128 for name in ("state", "inc"))
            and state.get("bit_generator") == "PCG64" and state.get("has_uint32") in (0, 1)
            and type(state.get("uinteger")) is int and 0 <= state["uinteger"] < 2**32):
        raise CheckpointError(f"{source}: rng is {brief(state)}, expected the batch sampler's PCG64 state "
                              '{"bit_generator": "PCG64", "state": {"state", "inc"}, "has_uint32", "uinteger"}')
    rng.bit_generator.state = state


def sample_text(run: LlamaRun, tokenizer, generator_box: list, tokens: int = 48) -> str:
    """Text generated from the trainer's current weights (temperature 0.8, top-k 50)."""
    from ..generate import Generator, Sampling

    if not generator_box:
        generator_box.append(Generator(language_model(run.model.config), run.model.initial, prefill=8))
    generator = generator_box[0]
    name = run.model.name
    for key in run.model.initial:  # the generator's weights are a copy: refresh them
        generator.network.globals[f"{name}/{key}"][...] = run.trainer.network.globals[f"{name}/{key}"]
    ids = list(generator.stream([tokenizer.bos_id], tokens, Sampling(temperature=0.8, top_k=50), seed=0, eos=tokenizer.eos_id))
    return tokenizer.decode(ids)


def train_llama(config: LlamaRunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
                stop_at: int | None = None, dashboard: bool = False) -> float:
    """Train (or resume); returns the final validation loss, printed with the unigram entropy.

    stop_at: pause after this step (checkpointed, schedule unchanged), to resume later.
    dashboard: show the live dashboard (on a terminal) instead of the progress bar.
    """
    rundir.write_config(run_dir, config.model, config)
    run = build(config, run_dir)
    trainer = run.trainer
    rundir.record_matmul(config, trainer.matmul)
    rundir.note_precision(config, trainer)
    rundir.write_config(run_dir, config.model, config)
    rng = np.random.default_rng(config.seed)
    metrics_path = run_dir / "metrics.jsonl"
    if resume and rundir.checkpoint_step(run_dir) is not None:
        metadata = trainer.load(run_dir / "checkpoint")
        restore_sampler_rng(rng, metadata.get("rng"), run_dir / "checkpoint" / METADATA)
        trainer.schedule = lr_schedule(config)  # the run's config plans it: a resume may have changed --steps
    rundir.keep_metrics_until(metrics_path, trainer.step_count)
    world = trainer.world
    progress, dashboard = progress and world.is_root, dashboard and world.is_root
    c = run.model.config
    experts = f", {c.n_experts} experts top-{c.top_k} ({c.active_parameter_count() / 1e6:.2f}M active)" if isinstance(run.model, MoE) else ""
    print(f"model: {config.preset} dim {c.dim} layers {c.n_layers} heads {c.n_heads}/{c.n_kv_heads} vocab {c.vocab_size}, "
          f"{c.parameter_count() / 1e6:.2f}M parameters{experts}; compiled in {trainer.compile_seconds:.1f}s"
          f"{f' on each of {world.size} workers' if world.size > 1 else ''}; from step {trainer.step_count}")
    if world.size > 1:
        print(trainer.parallel_summary())
    tokens_per_step = config.batch * config.seq * config.accumulate
    flops_per_step = c.flops_per_token(config.seq) * tokens_per_step

    def checkpoint() -> None:
        trainer.save(run_dir / "checkpoint", {"rng": rng.bit_generator.state})

    tokenizer = load_tokenizer(run_tokenizer(run_dir))
    generators: list = []
    if dashboard:  # it shows where the step's time goes, which a GPU times only when asked
        trainer.reset_profile()
    with rundir.MetricsLog(metrics_path) as metrics:
        def run_step() -> tuple[int, float, float, dict]:
            x, y = run.train.sample(config.batch * config.accumulate, config.seq, rng,
                                    rows=world.rows(config.batch * config.accumulate))
            step_start = time.perf_counter()
            loss = trainer.step([x, y])
            seconds = time.perf_counter() - step_start
            step = trainer.step_count
            record = {"step": step, "loss": loss, "lr": trainer.schedule(step - 1), "ms": seconds * 1e3,
                      "tokens_per_s": tokens_per_step / seconds, "gflops": flops_per_step / seconds / 1e9,
                      **expert_metrics(trainer.watched)}
            if step % config.eval_every == 0:
                record["val_loss"] = validation_loss(run, config)
            metrics.write(record)
            if rundir.checkpoint_due(config, step, stop_at):
                checkpoint()
            return step, loss, seconds, record

        if config.minutes is not None:
            config.steps, plan = plan_steps(run_step, trainer.step_count, config.minutes, config.steps)
            print(plan)
            # A short budget warms up over at most a tenth of its steps, so that most decay.
            config.warmup = min(config.warmup, config.steps // 10)
            trainer.schedule = lr_schedule(config)
            rundir.write_config(run_dir, config.model, config)
        shown = training_display(
            config.steps, done=trainer.step_count, progress=progress, dashboard=dashboard,
            title=f"ranvier train {config.model} {config.preset}: {run_dir}", compile_seconds=trainer.compile_seconds,
            flops_per_step=flops_per_step, items_per_step=tokens_per_step, unit="tokens", profile=trainer.profile,
            sample=lambda: sample_text(run, tokenizer, generators), sample_every=config.sample_every,
            peak=lambda: measured_peak(config.backend, trainer.matmul),
        )
        with shown as show:
            while trainer.step_count < min(config.steps, stop_at or config.steps):
                show(*run_step())
            final = validation_loss(run, config)
            show.final({"val_loss": final})
        # Logged before the last checkpoint commits the run as finished: a run killed in between
        # resumes from the checkpoint before, which drops this line and logs it again.
        metrics.write({"step": trainer.step_count, "val_loss": final})
    checkpoint()
    rundir.note_skipped(config, trainer)
    print(f"validation_loss={final:.4f} unigram_entropy={run.unigram_entropy:.4f} (nats per token)")
    experts = expert_metrics(trainer.watched)
    if experts:
        shares = " ".join(f"{share:.2f}" for share in experts["expert_load"])
        print(f"expert_load_max_mean={experts['load_max_mean']:.3f} (the last step's most loaded layer, 1 is balanced; "
              f"each expert's share over all layers {shares})")
    return final


def resume_llama(run_dir: Path, flags: dict | None = None, progress: bool = True, dashboard: bool = False) -> float | None:
    """Continue a run from its checkpoint, to its configured steps or as `flags` (the
    command line's, by config field) say; None when it had finished."""
    config = read_run(run_dir)
    if not rundir.prepare_resume(run_dir, config, flags or {}):
        return None
    return train_llama(config, run_dir, resume=True, progress=progress, dashboard=dashboard)
