"""The command line: config overrides are accepted anywhere among a subcommand's options."""

from __future__ import annotations

import pytest

from areal_jax.cli import parse_command_line


def test_overrides_after_an_option_join_the_config_in_order():
    # the README's eval command: the config, an option, then an override
    args = parse_command_line(
        ["eval", "configs/recipes/qwen25_05b_gsm8k.yaml", "--checkpoint", "runs/x/hf_final", "eval.files=[a]"]
    )
    assert args.checkpoint == "runs/x/hf_final"
    assert args.rest == ["configs/recipes/qwen25_05b_gsm8k.yaml", "eval.files=[a]"]
    args = parse_command_line(["train", "--resume", "c.yaml", "a.b=1", "--overwrite", "c.d=2", "e.f=3"])
    assert args.resume and args.overwrite and args.rest == ["c.yaml", "a.b=1", "c.d=2", "e.f=3"]
    assert parse_command_line(["train", "--debug", "c.yaml"]).rest == ["c.yaml"]


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_command_line(["train", "c.yaml", "--no-such-option", "a.b=1"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --no-such-option" in capsys.readouterr().err
