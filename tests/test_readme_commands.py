"""The README's commands, run in the README's order.

The commands are read from README.md as written: its indented code lines and its inline `bash scripts/...`,
`areal-jax ...` and `.venv/bin/areal-jax ...` spans, in the order they appear. Each runs from the repository
root into one temporary output directory, made short by overrides appended to it, and is checked for what
the README says it does (its exit status, the files it writes, what it prints). A command that cannot run
here (one that needs an HF checkpoint or a dataset this test does not have; the test suite itself) is at
least parsed by the CLI, and its config file must exist. A command of a kind this file does not know fails
the test, so an edited README is tested as it is written. The main job's run is also the check that its live
display (its last frame), the TensorBoard event file, metrics.jsonl and the plots agree on the last step; the
`launch local` run is also the crash test of a rollout server (one is SIGKILLed mid-run: tests/killed_server.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_jax.cli import main, parse_command_line
from areal_jax.config import load_experiment
from areal_jax.configuration import to_yaml
from areal_jax.exit_codes import EXIT_USER_ERROR
from areal_jax.reporting.metric_keys import is_evaluation
from areal_jax.reporting.run_reporter import tensorboard_tag
from areal_jax.system.heldout_evaluator import THREAD_NAME, eval_due
from tests.killed_server import check_the_killed_server_run, run_killing_a_server
from tests.short_runs import SHORT_CHAIN_SUMS, SHORT_TRAIN_CPU
from tests.xla_flags import SUITE_FLAGS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAIN_CONFIG = "configs/chain_sums_cpu.yaml"  # what scripts/run_main.sh trains
CLI = ("areal-jax", ".venv/bin/areal-jax")
STEPS = 4  # enough for `plan --calibration` with --skip-steps 1: one step left out, three steady ones
SHORT = {  # appended to a command that trains this config: a few small steps, programs from the test cache
    MAIN_CONFIG: [
        *SHORT_CHAIN_SUMS,
        f"train_steps={STEPS}",
        f"train_checkpoint.every_steps={STEPS}",
        f"eval.every_steps={STEPS}",
        f"profile.start_step={STEPS}",  # the README's `profile.start_step=N`, for its `profile-summary`
        "profile.num_steps=1",
        "compilation_cache_dir=null",  # the test session's cache (tests/conftest.py), not runs/xla_cache
        "report.live=always",  # the live display, though stderr is a pipe: its last frame is checked
    ],
    "configs/train_cpu.yaml": [
        *SHORT_TRAIN_CPU,
        "report.plots=true",  # the README's output table lists plots/
        f"train_steps={STEPS}",
        "dataset.heldout=8",
        "rollout.staleness.batch_prompts=4",
        "rollout.workflow.n_samples=4",
        f"train_checkpoint.every_steps={STEPS}",
        f"eval.every_steps={STEPS}",
        "cluster.status_every_s=0.05",  # `launch local`: the servers' counters reach the calibration each (fast) step
        "compilation_cache_dir=null",
    ],
}
LAUNCH = [  # appended to `launch local` besides SHORT: long enough for a server's SIGKILL and restart to matter
    "train_steps=10",
    "cluster.weight_transfer=direct",  # the steady state pulled directly; the restarted server starts from Orbax
    "cluster.direct_store_every=2",  # ... from a stored version up to eta behind, and catches up
]
# The README's placeholders, bound to what this test has: CONFIG and RUN_DIR are those of the last run,
# <name> its name; D devices to split (a 2-core CPU), E the staleness bound, B prompts per step, I a server.
PLACEHOLDERS = {"D": "2", "E": "1", "B": "4", "I": "0"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FILE_SUFFIXES = (".json", ".jsonl", ".md", ".yaml", ".py", ".log", ".txt", ".png", ".safetensors")


@dataclass(frozen=True)
class ReadmeCommand:
    words: tuple[str, ...]
    line: int  # where it starts in README.md

    def __str__(self) -> str:
        return f"README.md:{self.line}: {shlex.join(self.words)}"


def readme_commands(text: str) -> list[ReadmeCommand]:
    """The commands of a README, in order: the lines of its indented code blocks, and the inline code spans
    that start with `bash scripts/`, `areal-jax` or `.venv/bin/areal-jax` (a span may wrap over lines; a
    trailing backslash continues it)."""
    found: list[tuple[int, str]] = []
    lines = text.split("\n")
    offset = 0
    in_block = False
    for number, line in enumerate(lines):
        in_block = line.startswith("    ") and line.strip() != "" and (in_block or number == 0 or not lines[number - 1])
        if in_block:
            found.append((offset, line.strip()))
        offset += len(line) + 1
    for span in re.finditer(r"`([^`]+)`", text):
        words = span.group(1).replace("\\\n", " ").split()
        if words and (words[0] in CLI or (words[0] == "bash" and words[1:2] and words[1].startswith("scripts/"))):
            found.append((span.start(), " ".join(words)))
    return [
        ReadmeCommand(tuple(shlex.split(source)), text.count("\n", 0, start) + 1) for start, source in sorted(found)
    ]


def _step_lines(run_dir: Path, cfg: Any) -> list[dict[str, Any]]:
    """metrics.jsonl's step lines, after checking its held-out evaluations' lines: one at each step the
    schedule evaluates (0, every `eval.every_steps`, the last), run by the rollout side's evaluation thread."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [m["train/version"] for m in lines if is_evaluation(m)]
    if cfg.eval.every_steps and cfg.dataset.heldout:
        assert evaluated == [v for v in range(cfg.train_steps + 1) if eval_due(cfg, v)], evaluated
        for version in evaluated:
            summary = json.loads((run_dir / "eval" / f"step-{version}" / "summary.json").read_text())
            assert summary["thread"] == THREAD_NAME
    return [m for m in lines if not is_evaluation(m)]


def display_tensorboard_and_plots_agree(run_dir: Path, done: subprocess.CompletedProcess[str]) -> None:
    """The live display's last frame (rich prints it when the display stops), the TensorBoard event file,
    metrics.jsonl and the plots of a finished run agree on the values of its last step."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = int(max(m["train/version"] for m in lines))
    last_eval = next(m for m in lines if is_evaluation(m) and m["train/version"] == steps)
    last = {**next(m for m in lines if not is_evaluation(m) and m["train/version"] == steps), **last_eval}
    display = done.stderr
    assert f"step {steps}/{steps}" in display
    for label, key, spec in (
        ("reward", "rollout/reward_mean", ".3f"),
        ("correct", "rollout/correct_mean", ".3f"),
        ("held-out pass@1", "eval/pass@1", ".3f"),
        ("interruptions", "generator/interruptions", ".0f"),
    ):
        shown = re.search(rf"{re.escape(label)}\s+(\S+)", display)
        assert shown is not None, f"{label!r} missing from the display:\n{display[-5000:]}"
        assert shown.group(1) == format(last[key], spec), (label, shown.group(1), last[key])
    staleness = re.search(r"staleness mean/max\s+(\S+) / (\S+)", display)
    expected = (format(last["rollout/staleness_mean"], ".2f"), format(last["rollout/staleness_max"], ".0f"))
    assert staleness is not None and staleness.groups() == expected

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("rollout/reward_mean", "rollout/correct_mean", "rollout/staleness_mean", "train/loss", "eval/pass@1"):
        points = {p.step: p.value for p in events.Scalars(tensorboard_tag(key))}
        assert tensorboard_tag(key) in tags and sorted(points)[-1] == steps
        assert math.isclose(points[steps], last[key], rel_tol=1e-6, abs_tol=1e-6), key

    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert plots == ["reward.png", "staleness.png", "throughput.png"]
    assert all((run_dir / "plots" / name).read_bytes()[:8] == PNG_MAGIC for name in plots)
    assert "plots:" in done.stdout  # the closing summary names them


def readme_outputs(text: str) -> list[str]:
    """The run-directory entries of the README's output table (its first column's code spans)."""
    table = text.split("| output | what |", 1)[1].split("\n\n", 1)[0]
    rows = [row.split("|")[1] for row in table.strip().split("\n")[1:]]  # after the |---| line
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row)]


def readme_config_keys(text: str, top_level: set[str]) -> set[str]:
    """The config keys the README names (`section.key`, also inside commands and as `key=value`)."""
    keys = set()
    for span in re.findall(r"`([^`]+)`", text):
        for key in re.findall(r"(?<![\w./-])([a-z_]+(?:\.[a-z0-9_]+)+)(?=[=:\s]|$)", span):
            if key.split(".")[0] in top_level and not key.endswith(FILE_SUFFIXES):
                keys.add(key)
    return keys


@dataclass
class Run:
    config: str
    directory: Path
    eta: int  # rollout.staleness.max_head_offpolicyness
    separate_roles: bool = False  # `launch local`: the two sides on cores of their own


@dataclass
class ReadmeSession:
    """Runs README commands one after another in one output directory, remembering the runs they made."""

    output_dir: Path
    runs: list[Run] = field(default_factory=list)
    done: list[tuple[str, ...]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        # `areal-jax` is this environment's; subprocesses share the suite's compilation cache and code
        # generator, and see one CPU device, as on a user's machine (not the suite's 8 virtual ones)
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        # (COLUMNS: the live display's width, one line per row of labels)
        return {**os.environ, "PATH": path, "XLA_FLAGS": SUITE_FLAGS, "COLUMNS": "200"}

    def execute(self, argv: list[str], expect: int = 0) -> subprocess.CompletedProcess[str]:
        started = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=600)
        print(f"{time.perf_counter() - started:6.1f} s  {shlex.join(argv[:5])}")  # shown with -s
        assert done.returncode == expect, (
            f"{shlex.join(argv)} exited {done.returncode}, not {expect}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
        return done

    def call(self, words: list[str], expect: int = 0) -> subprocess.CompletedProcess[str]:
        """A command that neither trains nor compiles (or is refused first), through the CLI's entry point (what
        the `areal-jax` script calls) in this process: a process of its own costs seconds of imports."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(words[1:])
        assert code == expect, f"{shlex.join(words)} exited {code}\n{out.getvalue()[-3000:]}\n{err.getvalue()[-3000:]}"
        return subprocess.CompletedProcess(words, code, out.getvalue(), err.getvalue())

    def bind(self, word: str, calibrating: bool) -> str:
        """A README word with its placeholders bound: a `runs/...` path goes into the output directory."""
        # a calibration run's two sides may not share cores while both run: a `launch local` run, or a
        # one-process run at eta 0
        runs = [run for run in self.runs if run.eta == 0 or run.separate_roles] if calibrating else self.runs
        last = runs[-1] if runs else None
        if word in PLACEHOLDERS:
            return PLACEHOLDERS[word]
        if last is not None and word in ("CONFIG", "RUN_DIR"):
            return last.config if word == "CONFIG" else str(last.directory)
        if last is not None:
            word = word.replace("<name>", last.directory.name)
        return str(self.output_dir / word.removeprefix("runs/")) if word.startswith("runs/") else word

    def run(self, command: ReadmeCommand) -> None:
        if command.words in self.done:
            return  # the README repeats it (`config --describe`): it ran where it came first
        self.done.append(command.words)
        calibrating = "--calibration" in command.words
        # `[--eta E]`: an optional part, given; a bracket inside a value (`dataset.files='[...]'`) stays
        words = [self.bind(word if "=" in word else word.strip("[]"), calibrating) for word in command.words]
        if words[:2] == ["bash", "scripts/run_tests.sh"]:
            self.the_test_command(words)
        elif words[:2] == ["bash", "scripts/run_main.sh"]:
            self.main_job(words)
        elif words[0] in CLI:
            self.cli(command, words)
        else:
            pytest.fail(f"{command}: no check for this kind of command")

    def the_test_command(self, words: list[str]) -> None:
        """Not run (it is this suite): it takes no arguments in the README and is what CI runs."""
        assert words == ["bash", "scripts/run_tests.sh"]
        ci = (ROOT / ".ci" / "run").read_text().splitlines()
        assert "bash scripts/run_tests.sh" in [line.strip() for line in ci], ".ci/run must run the README's tests"

    def main_job(self, words: list[str]) -> None:
        readme_overrides = [word for word in words[2:] if "=" in word]
        if readme_overrides:
            # an example of overrides (the synchronous baseline): they must name real keys and values; the
            # eta-0 wiring itself runs in tests/test_async_rl.py, and running it here again would cost the
            # suite ~20 s of its 10 minutes
            cfg = load_experiment(MAIN_CONFIG, readme_overrides)
            assert all(word.split("=", 1)[0] for word in readme_overrides) and cfg.train_steps > 0
            return
        argv = [*words, *SHORT[MAIN_CONFIG], f"output_dir={self.output_dir}"]
        done = self.execute(argv)
        overrides = [*readme_overrides, *SHORT[MAIN_CONFIG], f"output_dir={self.output_dir}"]
        self.trained(MAIN_CONFIG, overrides, done)
        display_tensorboard_and_plots_agree(self.runs[-1].directory, done)

    def trained(self, config: str, overrides: list[str], done: subprocess.CompletedProcess[str]) -> None:
        """A finished run of `config` with `overrides`: what the README says it writes, and its steps."""
        cfg = load_experiment(config, overrides)
        run_dir = Path(cfg.run_dir)
        assert to_yaml(load_experiment(run_dir / "config.yaml")) == to_yaml(cfg)  # the README's overrides too
        for entry in readme_outputs(README.read_text()):
            present = list(run_dir.glob(re.sub(r"\bN\b", "*", entry).rstrip("/")))  # eval/step-N/
            if entry == "warm_start/" and not cfg.warm_start.steps:
                assert not present, f"{run_dir}: a warm start although warm_start.steps is 0"
                continue
            assert present and all(p.is_dir() == entry.endswith("/") for p in present), f"{run_dir}: no {entry}"
        metrics = _step_lines(run_dir, cfg)
        assert [m["train/version"] for m in metrics] == list(range(1, cfg.train_steps + 1))  # a fresh run's only
        eta = cfg.rollout.staleness.max_head_offpolicyness
        assert max(m["rollout/staleness_max"] for m in metrics) <= eta
        summary = json.loads(done.stdout[done.stdout.index("\n{") :])  # the summary's JSON ends the output
        assert summary["version"] == cfg.train_steps and not summary["stopped_by_signal"]
        assert str(run_dir / "metrics.jsonl") in done.stdout  # the summary names what the run wrote
        self.runs.append(Run(config, run_dir, eta))

    def launch(self, config: str, words: list[str], readme_overrides: list[str]) -> None:
        """A `launch local --rollout 2` run, one server SIGKILLed mid-run: every step trained once, the rollout
        servers wrote the groups, the trainer exported the policy, the crash lost and repeated nothing."""
        overrides = [*readme_overrides, *SHORT[config], *LAUNCH, f"output_dir={self.output_dir}"]
        cfg = load_experiment(config, overrides)
        run_dir = Path(cfg.run_dir)
        argv = [*words, *SHORT[config], *LAUNCH, f"output_dir={self.output_dir}"]
        started = time.perf_counter()
        done, victim = run_killing_a_server(argv, ROOT, self.env(), run_dir)
        print(f"{time.perf_counter() - started:6.1f} s  {shlex.join(argv[:5])} (a server killed)")
        assert done.returncode == 0, (
            f"{shlex.join(argv)} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
        metrics = _step_lines(run_dir, cfg)
        assert [m["train/version"] for m in metrics] == list(range(1, cfg.train_steps + 1)), done.stdout[-3000:]
        assert (run_dir / "hf_final" / "config.json").is_file()
        eta = cfg.rollout.staleness.max_head_offpolicyness
        check_the_killed_server_run(
            run_dir, victim, eta, cfg.rollout.staleness.batch_prompts, done.stdout + done.stderr
        )
        self.runs.append(Run(config, run_dir, eta, True))

    def cli(self, command: ReadmeCommand, words: list[str]) -> None:
        args = parse_command_line(words[1:])  # every README command parses, whether it runs here or not
        rest = getattr(args, "rest", [])
        config = next((word for word in rest if "=" not in word), None)
        assert config is None or (ROOT / config).is_file(), f"{command}: no config file {config}"
        if args.command in ("trainer", "rollout") and not rest:
            return  # the roles that `launch local` starts (its run below), named without a config
        if args.command == "train" and config is None:
            return  # `areal-jax train` named in a sentence
        if args.command in ("train", "eval") and config not in SHORT:
            return  # a recipe on an HF checkpoint (`hf_checkpoint=...`) and a dataset that this test lacks
        if args.command in ("train", "launch") and config in SHORT:
            readme_overrides = [word for word in rest if "=" in word]  # e.g. the launch's own run name
            cfg = load_experiment(config, [*readme_overrides, f"output_dir={self.output_dir}"])
            if Path(cfg.run_dir).exists():
                # the run the README ran before it is there: a new run over it is refused, naming --overwrite
                argv = [*words, *SHORT[config], f"output_dir={self.output_dir}"]
                # (`launch` prints its trainer's output: a process of its own)
                run = self.execute if args.command == "launch" else self.call
                done = run(argv, expect=EXIT_USER_ERROR)
                said = [line for line in (done.stdout + done.stderr).splitlines() if "run directory:" in line]
                assert said and "--overwrite" in said[-1], done.stdout[-2000:] + done.stderr[-2000:]
                assert (Path(cfg.run_dir) / "hf_final").is_dir()  # and left alone
            elif args.command == "launch":
                self.launch(config, words, readme_overrides)
            else:
                overrides = [*SHORT[config], f"output_dir={self.output_dir}"]
                self.trained(config, overrides, self.execute([*words, *overrides]))
        elif args.command == "config" and args.describe:
            listed = {line.split(" ", 1)[0] for line in self.call(words).stdout.splitlines()}
            top_level = {key.split(".")[0] for key in listed}
            named = readme_config_keys(README.read_text(), top_level)
            unknown = {key for key in named if not any(k == key or k.startswith(f"{key}.") for k in listed)}
            assert named and not unknown, f"the README names config keys that `config --describe` lacks: {unknown}"
        elif args.command == "profile-summary":
            out = self.call(words).stdout
            assert str(args.directory) in out.splitlines()[0] and len(out.splitlines()) > 2, out
        elif args.command == "sft" and config in SHORT:
            overrides = [*SHORT[config], f"output_dir={self.output_dir}"]
            summary = json.loads(self.execute([*words, *overrides]).stdout)
            cfg = load_experiment(config, overrides)
            cached = json.loads((Path(cfg.run_dir) / "warm_start" / "summary.json").read_text())
            assert summary["steps"] == cached["steps"] == cfg.warm_start.steps  # the run's warm start, replaced
            assert list((Path(cfg.run_dir) / "warm_start").glob("*/config.json"))  # and its HF checkpoint
        elif args.command == "plan" and args.memory:
            out = self.call(words).stdout
            assert re.search(r"^(fits: |not checked)", out, re.MULTILINE), out
        elif args.command == "plan" and args.calibration:
            out = self.call([*words, "--skip-steps", "1"]).stdout  # the run has STEPS steps
            splits = [line.split()[:3] for line in out.splitlines() if re.match(r"\d+ : \d+ ", line)]
            assert splits == [[str(n), ":", str(args.devices - n)] for n in range(1, args.devices)], out
            assert re.search(r"^recommended: (\d+ inference : \d+ training|colocated on all)", out, re.M), out
        else:
            pytest.fail(f"{command}: no check for this kind of command")


def test_the_readme_commands_are_found_in_order() -> None:
    commands = readme_commands(README.read_text())
    words = [" ".join(c.words) for c in commands]
    assert [c.line for c in commands] == sorted(c.line for c in commands)
    assert words.index("bash scripts/run_main.sh") < words.index("bash scripts/run_tests.sh")  # the set-up
    assert all(c.words[0] == "bash" or c.words[0] in CLI for c in commands)
    assert any("rollout.staleness.max_head_offpolicyness=0" in c.words for c in commands)  # a wrapped span
    assert readme_outputs(README.read_text())[:2] == ["metrics.jsonl", "tensorboard/"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_readme_commands_run_in_the_readme_order(tmp_path: Path) -> None:
    session = ReadmeSession(tmp_path / "runs")
    for command in readme_commands(README.read_text()):
        session.run(command)
    # the main job, the one-minute job, its `launch local` twin (then the calibration reads the last)
    assert [(run.config, run.separate_roles) for run in session.runs] == [
        (MAIN_CONFIG, False),
        ("configs/train_cpu.yaml", False),
        ("configs/train_cpu.yaml", True),
    ]
