"""The ``cadence`` command: every subcommand's parser, in one place.

- ``cadence train``: train the embedded TinyGPT (`cadence.train`).
- ``cadence schedule show``: a pipeline schedule's grid, simulator statistics,
  channels and digest (`cadence.pipeline.schedule.show`).
- ``cadence schedule compare``: cadence's generators against torch pipelining's,
  in cadence's simulator (`cadence.pipeline.schedule.compare`; needs torch).
- ``cadence link RATE -- COMMAND``: run a command on an emulated cluster link
  (`cadence.link`).
- ``cadence bench {dp,step,fsdp,pp,collectives,pickle,precompile,schedules,scale,report}``:
  cadence against PyTorch's own implementations, side by side (`cadence.bench`).

Building the parser imports no torch; a subcommand imports what it needs when it
runs, so ``cadence schedule show`` and ``cadence --help`` work where torch is not
installed.

[Note: one line per error]
A refused input is a message for the person who typed it, not a bug report: `main`
prints one line on stderr, ``cadence <command>: error: <message>``, naming the flag or
config key, the value and the fix, and returns 2 (argparse's status for a usage
error). That covers argparse's own errors (the parsers raise instead of printing
the usage and exiting), a config file's, and every `CadenceError` that says an
input was refused (the ones that are also a ``ValueError`` or ``TypeError``). A run
that fails after it started (a rank raised, died or hung: `LaunchError`; a
checkpoint could not be written; an ``OSError``) is one line too, with status 1 and
a pointer to ``--debug``. ``--debug``, before or after the subcommand, re-raises
instead: Python prints the whole traceback (a rank's own is in the `LaunchError`'s
message), and ``python -m pdb -m cadence ...`` stops there. Anything else is a bug
in cadence and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any, NoReturn

from cadence.bench._run import KINDS as BENCH_KINDS  # torch-free, like this parser
from cadence.bench._run import OPTIONS as BENCH_OPTIONS
from cadence.bench._run import QUESTIONS as BENCH_QUESTIONS
from cadence.errors import CadenceError, CadenceValueError, UsageError
from cadence.launch import LaunchError
from cadence.pipeline.schedule.channels import CHANNEL_MODES
from cadence.pipeline.schedule.generators import SCHEDULE_NAMES
from cadence.train.config import TrainConfig, model_from_flags
from cadence.train.preflight import preflight

__all__ = [
    "UsageError",
    "add_bench_subcommand",
    "add_link_subcommand",
    "add_schedule_subcommand",
    "add_train_subcommand",
    "build_parser",
    "main",
]


class _OneLineParser(argparse.ArgumentParser):
    """Raises `UsageError` where argparse would print the usage and exit, so that
    `main` reports it in one line (see [Note: one line per error])."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see '{self.prog} --help'", self.prog)


def build_parser(
    train_defaults: dict[str, Any] | None = None, *, one_line_errors: bool = False
) -> argparse.ArgumentParser:
    """The ``cadence`` parser; ``train_defaults`` (from ``--config``) replace the
    defaults of ``cadence train``, so flags on the command line still win. With
    ``one_line_errors`` a bad command line raises `UsageError` (as `main` wants)
    instead of printing the usage and exiting (argparse's way)."""
    cls = _OneLineParser if one_line_errors else argparse.ArgumentParser
    parser = cls(
        prog="cadence",
        description="Distributed training in which the caller owns the timing.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error, raise it with Python's full traceback instead of one line "
        "(also accepted after the subcommand)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_subcommand(sub, train_defaults)
    add_schedule_subcommand(sub)
    add_bench_subcommand(sub)
    add_link_subcommand(sub)
    return parser


def _add_debug(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after the subcommand too. SUPPRESS: unless given here, the
    subcommand leaves the value the top-level parser set."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, show Python's full traceback instead of one line",
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``cadence ARGV`` and return its exit status: 0, 1 when a run failed, 2 when
    the input was refused (one line on stderr; see [Note: one line per error])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed: list[argparse.Namespace] = []
    try:
        return _run(argv, parsed)
    except (CadenceError, OSError) as exc:
        before_end = argv[: argv.index("--")] if "--" in argv else argv
        if "--debug" in before_end or any(getattr(a, "debug", False) for a in parsed):
            raise
        refused = isinstance(exc, (ValueError, TypeError)) and isinstance(exc, CadenceError)
        prog = exc.prog if isinstance(exc, UsageError) else _prog(argv)
        line = f"{prog}: error: {_summary(exc)}{_dash_hint(argv, exc)}"
        if not refused:
            line += " (--debug shows the full traceback)"
        print(line, file=sys.stderr)
        return 2 if refused else 1


def _run(argv: list[str], parsed: list[argparse.Namespace]) -> int:
    args = build_parser(_config_file_defaults(argv), one_line_errors=True).parse_args(argv)
    parsed.append(args)
    return int(args.func(args) or 0)


def _dash_hint(argv: list[str], exc: BaseException) -> str:
    """argparse reads ``--lr -inf`` as two flags: say how to pass such a value."""
    if not isinstance(exc, UsageError) or "expected one argument" not in str(exc):
        return ""
    for flag, value in itertools.pairwise(argv):
        if f"argument {flag}:" in str(exc) and value.startswith("-"):
            return f" ({value!r} looks like a flag: write {flag}={value})"
    return ""


def _prog(argv: list[str]) -> str:
    command = next((a for a in argv if not a.startswith("-")), None)
    return f"cadence {command}" if command in ("train", "schedule", "bench", "link") else "cadence"


def _flat(text: str) -> str:
    """``text`` on one line: its lines (any line break str.splitlines knows) joined."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _summary(exc: BaseException) -> str:
    if isinstance(exc, LaunchError):
        f = exc.failure
        if f.reason == "raised":
            head = f"rank {f.rank} raised {f.exc_type}: {_flat(f.message)}"
        elif f.reason == "timeout":
            head = (
                f"rank {f.rank} did not finish within the launch timeout ({f.message}; the "
                "[train] timeout key of --config); it may be hung in a collective"
            )
        else:
            head = (
                f"rank {f.rank} exited with code {f.exit_code} without raising a Python "
                f"exception ({_flat(f.message)})"
            )
        others = "".join(f"; rank {o.rank} {o.reason}" for o in exc.others)
        return f"{head}; every rank was stopped{others}"
    return _flat(str(exc)) or type(exc).__name__


def _config_file_defaults(argv: list[str]) -> dict[str, Any] | None:
    """``cadence train --config FILE``: the file's values as parser defaults."""
    rest = list(argv)
    while rest and rest[0] == "--debug":
        rest.pop(0)
    if not rest or rest[0] != "train":
        return None
    pre = _OneLineParser(prog="cadence train", add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(rest[1:])
    if known.config is None:
        return None
    from cadence.train.config_file import given_model_keys, read_config_file

    table = read_config_file(known.config)
    if "model_config" in table:  # --model-config's keys are added over the file's
        table["model_config_base"] = table.pop("model_config")
    model = table.pop("model", None)
    if model is not None:
        table.update(model_base=model, d_model=model.d_model, layers=model.n_layers)
        # A vocabulary the file names is the model's; one it leaves out follows --data.
        if "vocab_size" in given_model_keys(known.config):
            table.update(vocab_size=model.vocab_size)
    return table


# -- cadence train ----------------------------------------------------------------


def add_train_subcommand(
    subparsers: Any, defaults: dict[str, Any] | None = None
) -> argparse.ArgumentParser:
    """Add ``train`` to an argparse sub-parser collection (``defaults``: see `build_parser`)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train", help="train the embedded TinyGPT on N local ranks"
    )
    d = TrainConfig()
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="options from a TOML file ([train] table); flags given here win",
    )
    _run_flags(p.add_argument_group("the run"), d)
    _optimizer_flags(p.add_argument_group("the optimizer"), d)
    _model_flags(p.add_argument_group("the model"), d)
    _data_flags(p.add_argument_group("the data"), d)
    _parallel_flags(p.add_argument_group("parallelism"), d)
    _checkpoint_flags(p.add_argument_group("the run folder"), d)
    _output_flags(p.add_argument_group("what the run reports"), d)
    _add_debug(p)
    # Options without a flag (a config file may set them), and the file's model shape.
    p.set_defaults(func=_train, timeout=d.timeout, model_base=d.model, model_config_base={})
    p.set_defaults(**(defaults or {}))
    return p


def _run_flags(g: Any, d: TrainConfig) -> None:
    """The run: ranks, steps, batch, seed, timeouts."""
    g.add_argument(
        "--nproc", type=int, default=d.nproc, help="local ranks (ignored under torchrun)"
    )
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch per step")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--collective-timeout",
        type=float,
        default=d.collective_timeout,
        metavar="S",
        help="seconds a collective waits for its peers before the rank stops with an error",
    )


def _optimizer_flags(g: Any, d: TrainConfig) -> None:
    """The optimizer: AdamW's learning rate, its schedule, clipping."""
    g.add_argument("--lr", type=float, default=d.lr, help="AdamW's (peak) learning rate")
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=d.warmup_steps,
        metavar="N",
        help="raise the learning rate linearly to --lr over the first N steps (0: none)",
    )
    g.add_argument(
        "--lr-schedule",
        choices=["constant", "cosine"],
        default=d.lr_schedule,
        help="after the warmup: keep --lr, or decay it to --min-lr by the last step",
    )
    g.add_argument(
        "--min-lr",
        type=float,
        default=d.min_lr,
        help="with --lr-schedule cosine: the final learning rate (default 0)",
    )
    g.add_argument(
        "--clip-grad-norm",
        type=float,
        default=d.clip_grad_norm,
        metavar="X",
        help="scale the gradients to a global norm of at most X (over the whole model)",
    )


def _model_flags(g: Any, d: TrainConfig) -> None:
    """The model: TinyGPT's shape, or another model."""
    g.add_argument(
        "--model",
        dest="model_factory",
        default=d.model_factory,
        metavar="FACTORY",
        help="train another model than TinyGPT: llama, hf:<ClassName> (transformers, from "
        "--model-config, no weights) or package.module:factory (returns an nn.Module)",
    )
    g.add_argument(
        "--model-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="--model's keyword arguments, a JSON object (added over [train.model_config])",
    )
    g.add_argument("--d-model", type=int, default=d.model.d_model)
    g.add_argument("--layers", type=int, default=d.model.n_layers)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"the model's vocabulary (default: what --data needs, else {d.model.vocab_size})",
    )


def _data_flags(g: Any, d: TrainConfig) -> None:
    """The data: the synthetic task, or the user's tokens, and evaluation."""
    g.add_argument(
        "--data",
        default=d.data,
        metavar="PATH",
        help="train on stdlib (the Python standard library's source), token shards (.bin: "
        "nanoGPT or llm.c) or text files, instead of the synthetic Markov task",
    )
    g.add_argument(
        "--data-dtype",
        default=d.data_dtype,
        choices=["", "uint16", "uint32"],
        help="id type of flat .bin shards (default: llm.c's header, else uint16)",
    )
    g.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        metavar="FILE.json",
        help="encode text --data with this tokenizers JSON file (default: byte-level)",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="with --data: the last fraction of tokens held out, never trained on (0.01)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        metavar="K",
        help="with --data: loss on the held-out tokens every K steps and after the last",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        default=d.eval_batches,
        help="with --eval-every: batches per evaluation (default 4)",
    )


def _parallel_flags(g: Any, d: TrainConfig) -> None:
    """Parallelism: data parallel, fully_shard, pipeline, compile."""
    g.add_argument(
        "--finalize",
        choices=["auto", "manual"],
        default=d.finalize,
        help="pp=1: finish reductions after backward (auto) or after the loss all-reduce",
    )
    g.add_argument(
        "--fsdp", action="store_true", help="cadence.fully_shard instead of DataParallel"
    )
    g.add_argument("--mixed-precision", choices=["none", "bf16"], default=d.mixed_precision)
    g.add_argument(
        "--ac",
        choices=["none", "full", "selective"],
        default=d.ac,
        help="activation checkpointing of each block: full keeps only its input and "
        "recomputes it in backward; selective also keeps its matmul and attention outputs",
    )
    g.add_argument(
        "--dp-replicate",
        type=int,
        default=d.dp_replicate,
        help="with --fsdp: HSDP replicas of the sharded data-parallel ranks (default 1)",
    )
    g.add_argument("--pp", type=int, default=d.pp, help="pipeline stages (ranks)")
    g.add_argument(
        "--schedule", default=d.schedule, help=f"with --pp: {', '.join(SCHEDULE_NAMES)} (1f1b)"
    )
    g.add_argument("--microbatches", type=int, default=d.microbatches, help="with --pp; 0 = 2 x pp")
    g.add_argument(
        "--chunks", type=int, default=d.chunks, help="with --pp: stages per rank; 0 = default"
    )
    g.add_argument(
        "--channel-mode",
        default=d.channel_mode,
        choices=["", *CHANNEL_MODES],
        help="with --pp: P2P communicators (per_directed_edge)",
    )
    g.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=d.bucket_cap_mb,
        help="DataParallel bucket size (default 0.25)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="precompile the forward once per data-parallel group (cadence.precompile)",
    )


def _checkpoint_flags(g: Any, d: TrainConfig) -> None:
    """The run folder: checkpoints, resume, overwrite."""
    g.add_argument("--run-dir", default="", help="default runs/<timestamp>")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="K",
        help="checkpoint to RUN_DIR/checkpoints/step-<N> every K steps and after the last",
    )
    g.add_argument(
        "--keep",
        type=int,
        default=d.keep,
        metavar="N",
        help="keep this run's newest N checkpoints (another run's are never deleted)",
    )
    g.add_argument(
        "--async-checkpoint", action="store_true", help="write checkpoints in the background"
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --run-dir (else start fresh); "
        "without --resume or --overwrite, a --run-dir that holds checkpoints is refused",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a --run-dir that holds an earlier run's checkpoints: delete "
        "them (every RUN_DIR/checkpoints/step-<N>) before the run starts; not with --resume",
    )
    g.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="with --resume: you vouch for --run-dir, so the checkpoint's signature is not "
        "checked (another user's or machine's, or an older cadence's); its hashes still are",
    )


def _output_flags(g: Any, d: TrainConfig) -> None:
    """What the run reports: MFU, samples, TensorBoard, exported weights."""
    g.add_argument(
        "--peak-flops",
        type=float,
        default=d.peak_flops,
        metavar="FLOPS",
        help="one device's peak FLOP/s, for the summary's MFU (omitted without it)",
    )
    g.add_argument(
        "--sample-tokens",
        type=int,
        default=d.sample_tokens,
        metavar="N",
        help="after training, generate N tokens (pp 1 only), print them and save "
        "RUN_DIR/samples.txt (0: none)",
    )
    g.add_argument(
        "--sample-temperature",
        type=float,
        default=d.sample_temperature,
        help="with --sample-tokens: sampling temperature (0, the default, is greedy)",
    )
    g.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files to RUN_DIR/tensorboard",
    )
    g.add_argument(
        "--export",
        default=d.export,
        metavar="DIR",
        help="after the last step, write the weights to DIR/model.safetensors (plain names; "
        "with config.json for a transformers model, loadable by from_pretrained)",
    )


def _json_object(text: str) -> dict[str, Any]:
    """``--model-config``'s value: a JSON object."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


def _train(args: argparse.Namespace) -> int:
    vocab = args.vocab_size
    if vocab is None and args.data:
        # Reads --data (one pass over shards): the refusals of a bad path come from here.
        from cadence.train.data.corpus import data_vocab

        vocab = data_vocab(args.data, dtype=args.data_dtype, tokenizer=args.tokenizer)
    model = model_from_flags(args.model_base, args.d_model, args.layers, vocab)
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.name not in ("model", "model_config")
    }
    kwargs = {**args.model_config_base, **(args.model_config or {})}
    cfg = TrainConfig(**values, model=model, model_config=kwargs)
    preflight(cfg)  # what this machine must give the run, before any rank starts
    if cfg.model_factory:
        # Imports torch and the factory's module: only for a --model run.
        from cadence.train.model_factory import check_model

        check_model(cfg)
    from cadence.train.run import train  # imports torch: only when training runs

    train(cfg)
    return 0


# -- cadence schedule show --------------------------------------------------------


def add_schedule_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``schedule show`` and ``schedule compare`` to an argparse sub-parser collection."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "schedule", help="inspect pipeline schedules (no process group)"
    )
    _add_debug(parser)
    sub = parser.add_subparsers(dest="schedule_command", required=True)
    show = sub.add_parser("show", help="ASCII grid, PNG and simulator statistics of a schedule")
    show.add_argument("name", help=f"{', '.join(SCHEDULE_NAMES)}, or a .csv/.json file")
    show.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    show.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m")
    show.add_argument(
        "--chunks", type=int, default=None, help="stages per rank v (default per schedule)"
    )
    show.add_argument("--out", type=Path, default=None, help="write a PNG here (needs matplotlib)")
    show.add_argument("--trace", type=Path, default=None, help="write a Chrome trace JSON here")
    show.add_argument("--mode", default="per_directed_edge", choices=list(CHANNEL_MODES))
    _add_debug(show)
    show.set_defaults(func=_schedule_show)
    cmp = sub.add_parser(
        "compare",
        help="makespan, peak activations and bubble of cadence's generators against torch's",
    )
    cmp.add_argument(
        "names", nargs="*", default=list(SCHEDULE_NAMES), help="schedules (default: all)"
    )
    cmp.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8], help="pipeline ranks p")
    cmp.add_argument(
        "--microbatches", "-m", type=int, nargs="+", default=None, help="default: a grid per p"
    )
    cmp.add_argument(
        "--chunks", type=int, default=None, help="v of the looped schedules (default 2)"
    )
    _add_debug(cmp)
    cmp.set_defaults(func=_schedule_compare)
    return parser


def _schedule_show(args: argparse.Namespace) -> int:
    from cadence.pipeline.schedule.show import show_schedule

    return show_schedule(
        str(args.name),
        pp=args.pp,
        microbatches=args.microbatches,
        chunks=args.chunks,
        out=args.out,
        trace=args.trace,
        mode=args.mode,
    )


def _schedule_compare(args: argparse.Namespace) -> int:
    from cadence.pipeline.schedule.compare import compare, format_table

    try:
        rows = compare(args.names, args.pp, args.microbatches, chunks=args.chunks)
    except ImportError as e:
        print(
            f"cadence schedule compare needs torch's pipelining generators to compare "
            f"against, and they cannot be imported here ({e}). Install torch, or use "
            "'cadence schedule show NAME' for cadence's own numbers.",
            file=sys.stderr,
        )
        return 1
    print(format_table(rows))
    return 0


# -- cadence bench ----------------------------------------------------------------


def add_bench_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to an argparse sub-parser collection."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="cadence vs PyTorch's own DDP, FSDP2, pipelining, torch.compile (and cloudpickle)",
    )
    parser.add_argument(
        "kind",
        choices=[*BENCH_KINDS, "report"],
        help="a comparison to run, or 'report' to regenerate docs/benchmarks.md",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (1-2 min each)")
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="the folder each run writes its record and chart into, and nothing elsewhere, "
        "and that 'report' reads (default: $XDG_CACHE_HOME/cadence/bench, else "
        "~/.cache/cadence/bench; never the current folder)",
    )
    parser.add_argument(
        "--docs", type=Path, default=None, help="with 'report': the page (docs/benchmarks.md)"
    )
    parser.add_argument(
        "--link",
        default=None,
        metavar="RATE[,delay=MS]",
        help="run the ranks on an emulated link: a network namespace whose loopback is "
        "shaped to RATE (2gbit, 500mbit,delay=1, 'unshaped' to count bytes); for 'step', "
        "'calibrated' runs every case at the rate where its wire time equals its backward, "
        "and 4x slower (docs/link.md)",
    )
    parser.add_argument(
        "--cases",
        default=None,
        metavar="NAME[,NAME...]",
        help="with 'step': only these cases (default: all)",
    )
    parser.add_argument(
        "--launches",
        type=int,
        default=1,
        metavar="N",
        help="with 'step --link calibrated': run every case N times, each on a fresh link "
        "with fresh ranks, and report the median over launches beside each launch's "
        "figures (default: 1)",
    )
    _add_bench_questions(parser)
    _add_debug(parser)
    parser.set_defaults(func=_bench)
    return parser


# The flags that ask a comparison a further question (cadence.bench._run.QUESTIONS), by
# argparse dest; the three of 'pickle' add to one run.
_BENCH_QUESTION_FLAGS = {
    "finalize_patterns": "finalize-patterns",
    "memtracker": "memtracker",
    "bubbles": "bubbles",
    "batch_p2p": "batch-p2p",
    "loads": "extended",
    "dill": "extended",
    "out_of_band": "extended",
}
# A run() keyword whose flag is not its name.
_BENCH_FLAG = {"world": "--nproc", "ship_kernels": "--no-ship-kernels"}


def _add_bench_questions(parser: argparse.ArgumentParser) -> None:
    """The further questions of ``cadence bench`` and their sizes (each writes a record of
    its own kind: see [Note: a further question writes a record of its own kind])."""
    ask = parser.add_argument_group(
        "further questions",
        "one comparison asked more; the record's kind is KIND-QUESTION (pp-bubbles), which "
        "'report' leaves off the page",
    )
    flag = ask.add_argument
    flag("--finalize-patterns", action="store_true", help="with 'dp': a CPU task after "
         "backward run while the all-reduces are in flight (manual finalize_backward()) "
         "against after them (auto, DDP), and the time blocked in wait()")  # fmt: skip
    flag("--profile", action="store_true",
         help="with 'dp --finalize-patterns': a cProfile of 10 cadence and 10 DDP steps")  # fmt: skip
    flag("--memtracker", action="store_true", help="with 'fsdp': peak memory by torch's "
         "MemTracker (storage resizes included), AdamW, at any --nproc and shape")  # fmt: skip
    flag("--bubbles", action="store_true", help="with 'pp': measured bubbles (time in the "
         "compute handlers) against the simulator's and the closed form")  # fmt: skip
    flag("--source", choices=["cadence", "torch"], default=None,
         help="with 'pp --bubbles': torch runs torch's own lowered lists under cadence's "
         "executor (default: cadence)")  # fmt: skip
    flag("--batch-p2p", action="store_true",
         help="with 'pp': batch_isend_irecv against one post per SEND/RECV")  # fmt: skip
    flag("--loads", action="store_true", help="with 'pickle': loads time as well as dumps")
    flag("--dill", action="store_true", help="with 'pickle': dill beside cadence")
    flag("--out-of-band", action="store_true", help="with 'pickle': large buffers under "
         "protocol 5 with a buffer_callback (memoryview, numpy, torch tensor)")  # fmt: skip
    size = parser.add_argument_group("sizes and variants", "defaults: each run's own")
    size.add_argument("--nproc", type=int, default=None, metavar="N",
                      help="local ranks, with 'precompile' (default 2) or a further question "
                      "of 'dp', 'fsdp', 'pp' (default 2)")  # fmt: skip
    for name, what in (("layers", "blocks"), ("width", "width (d_model)"),
                       ("batch", "batch per rank")):  # fmt: skip
        size.add_argument(f"--{name}", type=int, default=None, metavar="N",
                          help=f"the model's {what}, with a further question of 'dp', "
                          "'fsdp', 'pp'")  # fmt: skip
    size.add_argument("--shared-inductor-cache", action="store_true",
                      help="with 'precompile': one cold inductor cache for the ranks of a run "
                      "(one node) instead of one per rank")  # fmt: skip
    size.add_argument("--no-ship-kernels", action="store_true",
                      help="with 'precompile': artifacts without their C++ kernels")  # fmt: skip


def _bench_question(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """The further question the flags ask of ``args.kind``, and run()'s options; refuses
    a flag that does not apply, naming the runs it applies to."""
    asked = [dest for dest in _BENCH_QUESTION_FLAGS if getattr(args, dest)]
    for dest in asked:
        kind = BENCH_QUESTIONS[_BENCH_QUESTION_FLAGS[dest]].kind
        if kind != args.kind:
            raise CadenceValueError(
                f"--{dest.replace('_', '-')} applies to 'cadence bench {kind}', not {args.kind!r}"
            )
    questions = sorted({_BENCH_QUESTION_FLAGS[dest] for dest in asked})
    if len(questions) > 1:
        raise CadenceValueError(
            f"--{questions[0]} and --{questions[1]} are two runs of 'cadence bench "
            f"{args.kind}': give one at a time"
        )
    question = questions[0] if questions else None
    options: dict[str, Any] = {k: getattr(args, k) for k in ("layers", "width", "batch", "source")}
    options |= {"world": args.nproc, "profile": args.profile or None,
                "shared_inductor_cache": args.shared_inductor_cache or None,
                "ship_kernels": False if args.no_ship_kernels else None}  # fmt: skip
    options = {k: v for k, v in options.items() if v is not None}
    if question == "extended":
        options |= {k: getattr(args, k) for k in ("loads", "dill", "out_of_band")}
    allowed = BENCH_QUESTIONS[question].options if question else BENCH_OPTIONS.get(args.kind, ())
    for key in options:
        if key in allowed:
            continue
        runs = [f"'cadence bench {k}'" for k, opts in BENCH_OPTIONS.items() if key in opts]
        runs += [f"'cadence bench {q.kind} --{name}'" for name, q in BENCH_QUESTIONS.items()
                 if key in q.options and name != "extended"]  # fmt: skip
        here = f"cadence bench {args.kind}" + (f" --{question}" if question else "")
        raise CadenceValueError(
            f"{_BENCH_FLAG.get(key, '--' + key.replace('_', '-'))} does not apply to "
            f"'{here}'; it goes with {', '.join(runs)}"
        )
    return question, options


def _bench(args: argparse.Namespace) -> int:
    from cadence.bench import format_rows, run_bench, write_docs
    from cadence.bench._record import default_results_dir

    question, options = _bench_question(args)
    # Before anything runs: a count only a calibrated run honours is refused, not ignored.
    if args.launches != 1:
        from cadence.bench._launches import check_launches
        from cadence.bench._on_link import CALIBRATED

        calibrated = args.kind == "step" and (args.link or "").strip().lower() == CALIBRATED
        check_launches(args.launches, calibrated=calibrated)
    if args.results is None:
        args.results = default_results_dir()
    if args.kind == "report":
        if args.quick:
            raise CadenceValueError(
                "--quick applies to a comparison, not to 'cadence bench report'"
            )
        docs = args.docs or Path("docs/benchmarks.md")
        if not docs.parent.is_dir():
            # The default page is the repository's: outside a checkout there is no
            # docs/ folder, and creating one where the user stands would be a surprise.
            raise CadenceValueError(
                f"'cadence bench report' writes {docs}, but {docs.parent}/ does not exist "
                "here; run it from the cadence repository's root, or give --docs PATH"
            )
        print(f"wrote {write_docs(args.results, docs)}")
        return 0
    if args.docs is not None:
        raise CadenceValueError(
            f"--docs applies to 'cadence bench report' only; run 'cadence bench {args.kind}', "
            "then 'cadence bench report --docs PATH'"
        )
    if args.link is not None and (question or options):
        raise CadenceValueError(
            "--link runs a comparison as it is, without a further question or size: "
            "drop --link, or those flags"
        )
    if args.cases is not None:
        if args.kind != "step":
            raise CadenceValueError(f"--cases applies to 'cadence bench step', not {args.kind!r}")
        options["cases"] = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.link is not None:
        from cadence.bench._on_link import CALIBRATED, bench_on_link

        if args.link.strip().lower() == CALIBRATED:
            if args.kind != "step":
                raise CadenceValueError(
                    f"--link calibrated applies to 'cadence bench step', not {args.kind!r}; "
                    "give a rate, e.g. --link 2gbit"
                )
            from cadence.bench._calibrate import run_calibrated

            return run_calibrated(
                quick=args.quick, results=args.results, cases=options.get("cases"),
                launches=args.launches,
            )  # fmt: skip
        return bench_on_link(args.kind, args.link, quick=args.quick, results=args.results,
                             cases=options.get("cases"))  # fmt: skip
    record, path, chart = run_bench(
        args.kind, quick=args.quick, out_dir=args.results, question=question, **options
    )
    print(format_rows(record))
    print(f"record: {path}" + (f"; chart: {chart}" if chart else "; no chart (no matplotlib)"))
    return 0


# -- cadence link -----------------------------------------------------------------


def add_link_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``link`` to an argparse sub-parser collection."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "link",
        help="run a command (torchrun, your script) on an emulated cluster link (docs/link.md)",
    )
    parser.add_argument("spec", metavar="RATE[,delay=MS]", help="e.g. 2gbit or 500mbit,delay=1")
    parser.add_argument(
        "--no-check", action="store_true", help="skip the self-check transfer before the command"
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the command to run inside the link"
    )
    _add_debug(parser)
    parser.set_defaults(func=_link)
    return parser


def _link(args: argparse.Namespace) -> int:
    from cadence.link import EmulatedLink, LinkSpec

    # argparse's REMAINDER takes everything after RATE, this command's own flags too.
    command = list(args.command)
    while command and command[0] in ("--no-check", "--debug"):
        flag = command.pop(0)
        setattr(args, flag[2:].replace("-", "_"), True)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CadenceValueError(
            "give the command to run after --, e.g. "
            "'cadence link 2gbit -- torchrun --nproc-per-node 2 train.py'"
        )
    spec = LinkSpec.parse(args.spec)
    with EmulatedLink(spec) as link:
        if not args.no_check:
            print(link.self_check().line(spec), file=sys.stderr, flush=True)
        return link.run(command)


if __name__ == "__main__":
    sys.exit(main())
