"""The searchable parameters of a calibration study and their default ranges, and ``--range NAME=LO:HI``.

Apart from :mod:`hfkv.calibration.search` because ``hfkv calibrate``'s parser checks ``--range`` with
:func:`parse_range`: this module imports neither torch nor optuna, so ``hfkv calibrate --help`` stays cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hfkv.suggest import did_you_mean

if TYPE_CHECKING:
    import optuna


@dataclass(frozen=True)
class Param:
    name: str
    low: float
    high: float
    log: bool = False
    integer: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low > self.high:
            raise ValueError(f"--range {self.name}={self.low}:{self.high}: need finite LO <= HI")
        if self.log and self.low <= 0:
            raise ValueError(f"--range {self.name}={self.low}:{self.high}: a log-scale range needs LO > 0")

    def suggest(self, trial: optuna.Trial):
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)

    def to_list(self) -> list:
        return [self.low, self.high, self.log, self.integer]

    def nearest(self, value: float) -> float | int:
        """``value`` clipped into the range (of the parameter's type)."""
        v = min(max(value, self.low), self.high)
        return int(round(v)) if self.integer else float(v)


@dataclass(frozen=True)
class Choice:
    """A categorical parameter, for a setting no float range holds (alpha_h off = inf) but the base may use:
    the sampler must be able to reach the base's own policy, not only approximate it."""

    name: str
    choices: tuple = (False, True)

    def suggest(self, trial: optuna.Trial):
        return trial.suggest_categorical(self.name, list(self.choices))

    def to_list(self) -> list:
        return ["choice", *self.choices]


DEFAULT_RANGES: dict[str, Param] = {
    p.name: p
    for p in (
        Param("alpha_h", 0.0, 5.0),
        Param("alpha_l", 0.0, 0.1),
        Param("beta_h", -1.0, 2.0),
        Param("beta_l", -1.0, 2.0),
        Param("delta", -1.0, 1.0),
        Param("tau1", 1.0, 10.0),
        Param("tau2", 1.0, 10.0),
        Param("tau3", 1.0, 10.0),
        Param("gamma", 0.0, 500.0),
        Param("budget", 64, 2048, log=True, integer=True),
        Param("window", 8, 128, log=True, integer=True),
        Param("fidelity_mid", 0.5, 1.0),
        Param("fidelity_quantized", 0.0, 1.0),
    )
}
CHOICES: dict[str, Choice] = {"alpha_h_off": Choice("alpha_h_off")}


def parse_range(text: str) -> tuple[str, float, float]:
    """``NAME=LO:HI`` -> (name, lo, hi)."""
    name, sep, rng = text.partition("=")
    lo, sep2, hi = rng.partition(":")
    if not sep or not sep2:
        raise ValueError(f"--range {text!r}: expected NAME=LO:HI, e.g. alpha_h=0:3")
    if name not in DEFAULT_RANGES:
        hint = did_you_mean(name, DEFAULT_RANGES)
        raise ValueError(f"--range {text!r}: unknown parameter {name!r}{hint}; allowed: {sorted(DEFAULT_RANGES)}")
    try:
        return name, float(lo), float(hi)
    except ValueError as exc:
        raise ValueError(f"--range {text!r}: LO and HI must be numbers") from exc
