"""`model.lora`: low-rank adapters on the decoder's projections (a leaf of `ModelConfig`, checked against it there)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option

# The projections an adapter can be put on, in PEFT's naming order: attention q/k/v/o, MLP gate/up/down.
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Config):
    """LoRA (Hu et al. 2021) as PEFT defines it: each targeted projection W gains x @ A @ B * alpha / rank; only
    A and B train, the base stays frozen (out of the optimizer state and the gradients)."""

    rank: int = option(8, ge=1, doc="adapter rank r; at most the smaller width of every targeted projection")
    alpha: float = option(16.0, gt=0, doc="scale numerator: the adapter's output is multiplied by alpha / rank")
    targets: tuple[str, ...] = option(
        ("q", "k", "v", "o"), doc=f"projections that get an adapter, among {', '.join(TARGETS)}"
    )
    init: Literal["kaiming", "gaussian"] = option(
        "kaiming",
        doc="A's init (B starts at zero, so a fresh adapter leaves the base model unchanged): kaiming = PEFT's "
        "default, uniform in +-1/sqrt(fan_in); gaussian = normal with std 1/rank (PEFT init_lora_weights='gaussian')",
    )
    seed: int = option(0, doc="seed of A's init (its own stream: the base's init does not depend on the adapters)")
    dropout: float = option(
        0.0,
        ge=0,
        lt=1,
        doc="PEFT's lora_dropout: the probability of zeroing an adapter input entry (the rest scaled by 1 / (1 - p)) "
        "in the policy update's forward only; every log-prob pass, evaluation and the engines run without it",
    )
    export_merged: bool = option(
        False, doc="the final export also writes the merged full weights (W + A B alpha/r) as an HF checkpoint"
    )

    def validate(self) -> None:
        if not self.targets:
            raise ConfigError("targets", f"is empty; choose some of {list(TARGETS)}")
        for target in self.targets:
            if target not in TARGETS:
                close = difflib.get_close_matches(target, TARGETS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError("targets", f"unknown target {target!r}{hint}; allowed: {list(TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError("targets", f"value {list(self.targets)} names a projection twice")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_rank(lora: LoRAConfig, widths: dict[str, tuple[int, int]]) -> None:
    """Refuse a rank above the smaller width of a targeted projection (`widths`: target -> (input, output))."""
    for target in lora.targets:
        narrowest = min(widths[target])
        if lora.rank > narrowest:
            raise ConfigError(
                "lora.rank",
                f"value {lora.rank} exceeds the width of projection {target!r} ({widths[target][0]} -> "
                f"{widths[target][1]}); allowed: 1 <= rank <= {narrowest}",
            )
