"""The `areal-jax` command: `train` (asynchronous RL, the main job), `sft` (the supervised warm start of a
config, cached in its run directory for `train`), `eval` (pass@1/avg@k/pass@k of a checkpoint on datasets),
`demo` (generate and score with a fresh model), `config` (print or describe a config), `convert` (re-export
an HF checkpoint), `profile-summary` (rank the XLA operations of a trace taken with `profile.start_step=N`),
`plan` (the inference:training device split from a calibration run), `compile` (the trainer's and the engine's
programs compiled for Cloud TPU slices on any machine: docs/tpu.md), `trainer`, `rollout` and `launch local`
(the roles as processes).

A user mistake (a bad config, a missing file, a refused run directory) ends in one line on stderr and exit
status 2 (`--debug`: its traceback); `train` stopped by SIGTERM/SIGINT exits with 75 after its checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from areal_jax.configuration import ConfigError, describe, to_yaml
from areal_jax.exit_codes import EXIT_RESUMABLE, EXIT_RUN_FAILED, EXIT_USER_ERROR

logger = logging.getLogger("areal_jax")


def _user_errors() -> tuple[tuple[type[Exception], str], ...]:
    """The exceptions that are user mistakes (a config, a file, a directory), each with the prefix of its
    one-line message; the first match wins. Any other exception is an internal error and keeps its traceback."""
    from areal_jax.data.datasets import MalformedRowError
    from areal_jax.jobs.evaluate import CheckpointSourceError
    from areal_jax.models.hf_config import CheckpointError
    from areal_jax.planning.calibration import CalibrationError
    from areal_jax.system.run_dir import RunDirectoryError

    return (
        (ConfigError, "config error"),
        (CalibrationError, "calibration"),
        (RunDirectoryError, "run directory"),
        (CheckpointSourceError, "--checkpoint"),
        (CheckpointError, "HF checkpoint"),
        (MalformedRowError, "dataset"),
        (FileNotFoundError, "missing file"),
        (PermissionError, "permission denied"),
    )


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """First argument that is a YAML path (not key=value) is the config file; the rest are overrides."""
    path = None
    overrides = []
    for arg in args:
        if "=" not in arg and path is None:
            path = arg
        else:
            overrides.append(arg)
    return path, overrides


def _cmd_config(args: argparse.Namespace) -> int:
    from areal_jax.config import ExperimentConfig, load_experiment

    if args.describe:
        print("\n".join(describe(ExperimentConfig)))
        return 0
    path, overrides = _split_config_args(args.rest)
    print(to_yaml(load_experiment(path, overrides)), end="")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from areal_jax.compilation_cache import enable_compilation_cache
    from areal_jax.config import load_experiment
    from areal_jax.jobs.demo import run_demo

    path, overrides = _split_config_args(args.rest)
    cfg = load_experiment(path, overrides)
    enable_compilation_cache(cfg.compilation_cache_dir)
    started = time.perf_counter()
    summary = run_demo(cfg)
    summary["wall_seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(summary, indent=2))
    return 0


def _run_config(args: argparse.Namespace) -> Any:
    """The command's experiment config (file + overrides), with its compilation cache turned on."""
    from areal_jax.compilation_cache import enable_compilation_cache
    from areal_jax.config import load_experiment

    path, overrides = _split_config_args(args.rest)
    cfg = load_experiment(path, overrides)
    enable_compilation_cache(cfg.compilation_cache_dir)
    return cfg


def _training_done(summary: Any) -> int:
    print(json.dumps(dataclasses.asdict(summary), indent=2))
    return EXIT_RESUMABLE if summary.stopped_by_signal else 0


def _cmd_train(args: argparse.Namespace) -> int:
    from areal_jax.jobs.train import run_async
    from areal_jax.profiling import request_cpu_op_events

    cfg = _run_config(args)
    if cfg.profile.start_step:
        request_cpu_op_events()
    return _training_done(run_async(cfg, resume=args.resume, overwrite=args.overwrite))


def _cmd_trainer(args: argparse.Namespace) -> int:
    from areal_jax.jobs.trainer_role import run_trainer

    return _training_done(run_trainer(_run_config(args), resume=args.resume, overwrite=args.overwrite))


def _cmd_rollout(args: argparse.Namespace) -> int:
    import signal
    import threading

    from areal_jax.jobs.rollout_server import RolloutServerError, run_rollout_server

    cfg = _run_config(args)
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on every poll of a read-only store
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        summary = run_rollout_server(cfg, args.server, stop_event=stop)
    except RolloutServerError as err:
        print(f"areal-jax rollout: server {args.server} failed: {err}", file=sys.stderr)
        return EXIT_RUN_FAILED
    print(json.dumps(dataclasses.asdict(summary), indent=2))
    return EXIT_RESUMABLE if summary.ended_by == "signal" else 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from areal_jax.config import load_experiment
    from areal_jax.jobs.launcher import launch_local

    path, overrides = _split_config_args(args.rest)
    cfg = load_experiment(path, [*overrides, f"cluster.rollout_servers={args.rollout}"])
    return launch_local(
        cfg,
        args.rest,
        rollout_servers=args.rollout,
        trainer_cores=args.trainer_cores,
        trainer_processes=args.trainer_processes,
        rollout_processes=args.rollout_processes,
        resume=args.resume,
        overwrite=args.overwrite,
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from areal_jax.config import load_experiment
    from areal_jax.jobs.calibrate import calibrate
    from areal_jax.planning.calibration import CalibrationError, read_calibration
    from areal_jax.planning.plan import make_plan

    path, overrides = _split_config_args(args.rest)
    cfg = load_experiment(path, overrides)
    if args.memory:
        from areal_jax.planning.memory_command import print_memory_plan

        return print_memory_plan(cfg, args.topology, args.rollout_topology, args.devices, args.device_memory_gib)
    if args.devices is None:
        raise ConfigError("--devices", "is required to plan the split (or give --memory for the memory plan)")
    runs = list(args.calibration)
    if args.calibrate:
        runs.append(calibrate(path, overrides, args.calibration_steps))
    if not runs:
        raise CalibrationError("no calibration run: give --calibration RUN_DIR (a finished run) or --calibrate")
    calibrations = [read_calibration(run, args.skip_steps, args.step_quantile) for run in runs]
    plan = make_plan(cfg, calibrations, args.devices, eta=args.eta, batch_prompts=args.batch_prompts)
    print("\n".join(plan.lines()))
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from areal_jax.compile.report import compile_for_slice
    from areal_jax.config import load_experiment

    path, overrides = _split_config_args(args.rest)
    cfg = load_experiment(path, overrides)
    report = compile_for_slice(cfg, args.topology, args.rollout_topology, every_bucket=args.every_bucket)
    print(json.dumps(report.to_json(), indent=2) if args.json else "\n".join(report.lines()))
    report.check()
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from areal_jax.jobs.sft import run_warm_start
    from areal_jax.system.assembly import build_tokenizer
    from areal_jax.system.run_dir import check_run_location

    cfg = _run_config(args)
    if not cfg.warm_start.steps:
        raise ConfigError("warm_start.steps", "is 0: the config has no warm start; set warm_start.steps=N")
    check_run_location(cfg)
    summary = run_warm_start(cfg, build_tokenizer(cfg))
    summary.pop("settings")
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from areal_jax.compilation_cache import enable_compilation_cache
    from areal_jax.config import load_experiment
    from areal_jax.jobs.evaluate import resolve_checkpoint, run_eval, with_adapter

    path, overrides = _split_config_args(args.rest)
    source = resolve_checkpoint(args.checkpoint)
    if args.adapter is not None:
        source = with_adapter(source, args.adapter)
    if path is None and source.config_file is not None:
        path = source.config_file
        logger.info("config: %s (the run's)", path)
    cfg = load_experiment(path, overrides)
    enable_compilation_cache(cfg.compilation_cache_dir)
    report, json_path, md_path = run_eval(cfg, source, args.output or source.default_output)
    report.print()
    print(f"wrote {json_path}\nwrote {md_path}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint

    cfg, model = load_hf_checkpoint(args.source)
    save_hf_checkpoint(cfg, model, args.destination, max_shard_bytes=args.max_shard_mb * 1024**2)
    print(f"{args.source} -> {args.destination}: {cfg.family}, {cfg.num_params():,} parameters")
    return 0


def _cmd_profile_summary(args: argparse.Namespace) -> int:
    from areal_jax.profiling import format_summary, newest_trace, summarize_trace

    ops = summarize_trace(args.directory, top=args.top)
    print(f"{newest_trace(args.directory)}")
    print(format_summary(ops))
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count of processes (at least 1)")
    return value


def _at_least(minimum: int, what: str) -> Any:
    """An argparse type: an integer of at least `minimum`, else an error saying what it counts."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}: {what}")
        return value

    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--resume, --overwrite and the config with its overrides: the arguments of a command that trains."""
    parser.add_argument("--resume", action="store_true", help="continue from the newest training checkpoint")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete an earlier run in the run directory and start over"
    )
    parser.add_argument("rest", nargs="*", help="[config.yaml] [section.key=value ...]")


def build_parser() -> argparse.ArgumentParser:
    debug_help = "show the traceback of a user mistake (a bad config, a missing file) instead of one line"
    parser = argparse.ArgumentParser(prog="areal-jax", description=__doc__)
    parser.add_argument("--debug", action="store_true", help=debug_help)
    debug = argparse.ArgumentParser(add_help=False)  # --debug also after the command
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        parents=[debug],
        help="asynchronous RL on the embedded arithmetic task (one process)",
        epilog=f"exit status: 0 done, {EXIT_USER_ERROR} a user mistake, {EXIT_RESUMABLE} stopped by "
        "SIGTERM/SIGINT after writing a checkpoint (rerun with --resume)",
    )
    _add_run_arguments(train)
    train.set_defaults(func=_cmd_train)
    trainer = sub.add_parser(
        "trainer",
        parents=[debug],
        help="the trainer of a run whose rollout servers are separate processes (`areal-jax rollout`)",
        epilog=f"exit status: 0 done, 1 the run failed, {EXIT_USER_ERROR} a user mistake, {EXIT_RESUMABLE} "
        "stopped by SIGTERM/SIGINT after writing a checkpoint (rerun with --resume)",
    )
    _add_run_arguments(trainer)
    trainer.set_defaults(func=_cmd_trainer)
    rollout = sub.add_parser(
        "rollout",
        parents=[debug],
        help="rollout server I of cluster.rollout_servers, for the trainer of the same run directory",
        epilog=f"exit status: 0 the trainer stopped or the prompts ran out, 1 failed, {EXIT_RESUMABLE} a signal",
    )
    rollout.add_argument("--server", type=int, default=0, help="this server's index, 0..cluster.rollout_servers-1")
    rollout.add_argument("rest", nargs="*", help="[config.yaml] [section.key=value ...]")
    rollout.set_defaults(func=_cmd_rollout)
    launch = sub.add_parser("launch", parents=[debug], help="start a run's roles as processes")
    launch_where = launch.add_subparsers(dest="where", required=True)
    local = launch_where.add_parser(
        "local",
        parents=[debug],
        help="the trainer (M processes) and N rollout servers on this machine, each role on its own CPU cores",
    )
    local.add_argument("--rollout", type=int, default=1, help="rollout server processes")
    local.add_argument("--trainer-cores", type=int, help="CPU cores of the trainer (default: half)")
    local.add_argument(
        "--trainer-processes",
        type=_at_least_one,
        default=1,
        help="trainer processes (jax.distributed on localhost, one global mesh); they share the trainer's cores",
    )
    local.add_argument(
        "--rollout-processes",
        type=_at_least_one,
        default=1,
        help="processes per rollout server (one jax.distributed job per server, its engine over all of them; "
        "restarted whole); they share the rollout cores",
    )
    _add_run_arguments(local)
    local.set_defaults(func=_cmd_launch)
    plan = sub.add_parser(
        "plan",
        parents=[debug],
        help="recommend the inference:training split of D devices (CPU: cores) and predict the step time",
        epilog="reads finished runs (`train`, `launch local`): docs/distributed.md, 'Choosing the split'",
    )
    plan.add_argument(
        "--calibration",
        type=str,
        action="append",
        default=[],
        help="a finished run's directory, local or gs:// (repeatable: runs on other device counts or topologies "
        "add measurements)",
    )
    plan.add_argument(
        "--calibrate",
        action="store_true",
        help="first run the config briefly with `launch local` (CPU cores halved) into <name>-calibration, and use it",
    )
    plan.add_argument("--calibration-steps", type=_at_least(6, "steps of the --calibrate run"), default=16)
    plan.add_argument(
        "--memory",
        action="store_true",
        help="print the run's memory plan per device of each mesh (nothing compiles, no tokenizer, no weights) "
        "on this machine's devices or on --topology / --devices with --device-memory-gib, and whether it fits; "
        "exit 2 if it cannot",
    )
    plan.add_argument(
        "--devices",
        type=_at_least(2, "a split needs at least 2 devices (CPU: cores)"),
        help="devices to split (on CPU: cores); required without --memory. With --memory and "
        "--device-memory-gib: GPUs to plan for",
    )
    plan.add_argument(
        "--topology", help="with --memory: plan for this Cloud TPU slice (v5e-8, v5p-8, v6e-8, ...), not this machine"
    )
    plan.add_argument("--rollout-topology", help="with --memory --topology: the rollout side's own slice")
    plan.add_argument(
        "--device-memory-gib", type=float, help="with --memory --devices N: plan for N GPUs of this much memory"
    )
    plan.add_argument(
        "--eta", type=_at_least(0, "the staleness bound"), help="default: rollout.staleness.max_head_offpolicyness"
    )
    plan.add_argument(
        "--batch-prompts", type=_at_least(1, "prompts per step"), help="default: rollout.staleness.batch_prompts"
    )
    plan.add_argument(
        "--skip-steps",
        type=_at_least(1, "warm-up steps left out"),
        help="warm-up steps of each calibration run left out (default: a quarter, at least 2)",
    )
    plan.add_argument(
        "--step-quantile",
        type=_fraction,
        default=0.5,
        help="the quantile of the steady steps' times taken (0.5: the median; lower, e.g. 0.25, on a machine "
        "shared with other work, whose load only slows steps)",
    )
    plan.add_argument("rest", nargs="*", help="[config.yaml] [section.key=value ...]: the config to plan for")
    plan.set_defaults(func=_cmd_plan)
    sft = sub.add_parser(
        "sft",
        parents=[debug],
        help="train the config's supervised warm start (warm_start.steps) into <run>/warm_start; `train` uses it",
    )
    sft.add_argument("rest", nargs="*", help="[config.yaml] [section.key=value ...]")
    sft.set_defaults(func=_cmd_sft)
    evaluate = sub.add_parser("eval", parents=[debug], help="evaluate a checkpoint (pass@1, avg@k, pass@k) on datasets")
    evaluate.add_argument(
        "--checkpoint",
        type=str,
        required=True,
        help="an HF checkpoint directory, or a run directory of `train` (its hf_final/, else its newest "
        "checkpoint); local or gs://",
    )
    evaluate.add_argument(
        "--output", type=str, help="directory of eval.json and eval.md (local or gs://); default <checkpoint>/eval"
    )
    evaluate.add_argument(
        "--adapter",
        type=str,
        help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) applied over the HF "
        "checkpoint --checkpoint names",
    )
    evaluate.add_argument(
        "rest", nargs="*", help="[config.yaml] [section.key=value ...]; default config: the run's config.yaml"
    )
    evaluate.set_defaults(func=_cmd_eval)
    demo = sub.add_parser(
        "demo", parents=[debug], help="generate and score completions on the configured dataset and reward"
    )
    demo.add_argument("rest", nargs="*", help="[config.yaml] [section.key=value ...]")
    demo.set_defaults(func=_cmd_demo)
    config = sub.add_parser("config", parents=[debug], help="print the resolved config as YAML")
    config.add_argument("--describe", action="store_true", help="list every option with its range and doc")
    config.add_argument("rest", nargs="*", help="[config.yaml] [section.key=value ...]")
    config.set_defaults(func=_cmd_config)
    convert = sub.add_parser(
        "convert", parents=[debug], help="load an HF checkpoint into areal-jax params and export it again"
    )
    convert.add_argument("source", type=Path)
    convert.add_argument("destination", type=Path)
    convert.add_argument("--max-shard-mb", type=int, default=2048)
    convert.set_defaults(func=_cmd_convert)
    summary = sub.add_parser(
        "profile-summary", parents=[debug], help="rank the XLA operations of a profile trace by total time"
    )
    summary.add_argument("directory", type=Path, help="a run's profile/ directory (or any trace directory)")
    summary.add_argument("--top", type=int, default=25)
    summary.set_defaults(func=_cmd_profile_summary)
    compile_parser = sub.add_parser(
        "compile",
        parents=[debug],
        help="compile the run's trainer and engine programs for Cloud TPU slices here (no weights, no tokenizer)",
        epilog="per chip: the compiler's memory beside the plan, FLOPs, roofline and collectives (docs/tpu.md); "
        "exit status 2 when a side cannot fit, naming the keys to change",
    )
    compile_parser.add_argument("--topology", required=True, help="the slice, e.g. v5e-8, v5p-8, v6e-8, v5p-64")
    compile_parser.add_argument(
        "--rollout-topology", default=None, help="the rollout side's own slice (default: it shares --topology)"
    )
    compile_parser.add_argument(
        "--every-bucket",
        action="store_true",
        help="compile the engine's prefill, insert and decode at every length and row bucket (default: the largest)",
    )
    compile_parser.add_argument("--json", action="store_true", help="print the report as JSON")
    compile_parser.add_argument("rest", nargs="*", help="[config.yaml] [section.key=value ...]")
    compile_parser.set_defaults(func=_cmd_compile)
    return parser


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, config overrides accepted anywhere among the options (`eval CONFIG --checkpoint
    DIR eval.files=[...]`): argparse gives a subcommand's positionals only their first run, the later
    `section.key=value` words are appended to it in order; an unknown option is still an error."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [word for word in extra if word.startswith("-") or not hasattr(args, "rest")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.rest = [*args.rest, *extra]
    return args


def configure_logging() -> None:
    """INFO to stderr (and `train.log`, whose handler the run adds), less the libraries that talk too much: the
    HTTP clients' one line per request (the agents' `openai` client) among them."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("jax", "absl", "orbax", "fsspec", "gcsfs", "httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user mistake ends in one line on stderr and `EXIT_USER_ERROR` (with --debug: its
    traceback), any other exception propagates with its traceback."""
    configure_logging()
    args = parse_command_line(argv)
    from areal_jax.system.stop_control import RunFailed

    try:
        return args.func(args)
    except RunFailed as err:  # not a mistake in the command: the run itself could not go on
        if args.debug:
            traceback.print_exc()
        print(f"areal-jax {args.command}: run failed: {err}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except Exception as err:
        prefix = next((prefix for kind, prefix in _user_errors() if isinstance(err, kind)), None)
        if prefix is None:
            raise
        if args.debug:
            traceback.print_exc()
        else:
            message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
            print(f"areal-jax {args.command}: {prefix}: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


def entry_point() -> None:
    """The `areal-jax` command: `main`, then an exit that skips the interpreter's last garbage collection.
    That collection walks every object a run made (1.5-2.5 s per process here, paid again by each restarted
    server and each test's subprocess) only to free memory the exit frees anyway; files, logs and checkpoints
    are closed by the command itself, and objects still run their reference-count finalizers."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
