"""The claims of a paper next to churnsim's numbers for them, and how a verdict is reached.

`churnsim reproduce PAPER` (sim/checks/reproduce_checkfree.py, sim/checks/reproduce_datastates.py) lists every
published claim of one paper (as the paper, its authors' code or blog state it), the number churnsim gives for it from a
preset of that paper's setup, and a verdict:

- a value ("631 s"): "agrees within 10 %" or "agrees within 25 %" when churnsim's number is that close
  (relative to the paper's), else "disagrees (+x %)";
- a speed-up ("2.2×"): the same, on the gain (speed-up − 1): 1.01× against 1.2× is 95 % short of a
  20 % gain, not 16 % short of 1.2;
- a bound ("over 12 % faster", "up to 1.6×"): a floor is met when churnsim's number reaches it; an "up
  to" is a largest speed-up, compared as a speed-up;
- a range ("1.3–2.2×"): churnsim's range is compared end to end as two speed-ups;
- a calibration input: churnsim was fitted to it, so agreement says nothing ("fitted: ..."), and the
  verdict says so;
- a claim churnsim has no model for: "not checked", with the reason.

A disagreement always comes with its explanation; so does every agreement that holds for a reason
other than the model's (a fit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd

AGREEMENT_LEVELS: tuple[float, ...] = (0.10, 0.25)
"""Relative differences under which churnsim "agrees within" 10 % or 25 % of a published value."""

Comparison = Literal["value", "speedup", "at_least", "range", "input", "not_checked"]

CLAIM_COLUMNS: tuple[str, ...] = (
    "id", "claim", "source", "setting", "paper", "churnsim", "verdict", "why", "preset",
    "paper_value", "paper_value_high", "churnsim_value", "churnsim_value_high", "relative_difference",
)
"""claims.csv: the numeric columns hold a value, or the low and high ends of a range (NaN where none)."""


@dataclass(frozen=True, kw_only=True)
class Claim:
    """One published claim and churnsim's answer to it."""

    id: str
    claim: str
    """What the paper says, in our words."""
    source: str
    """Where (paper + table/figure/section, or the reference sheet's tag)."""
    setting: str
    paper_value: float | tuple[float, float]
    """The published number, or (low, high) of a range."""
    paper_text: str
    churnsim_value: float | tuple[float, float] | None
    churnsim_text: str
    comparison: Comparison
    preset: str
    """The preset (or presets) churnsim's number comes from."""
    why: str = ""
    """Why churnsim differs, or what an agreement rests on (a fit); shown with the verdict."""
    verdict: str = field(default="")

    def __post_init__(self) -> None:
        if not self.verdict:
            object.__setattr__(self, "verdict", verdict_of(self.comparison, self.paper_value, self.churnsim_value))

    @property
    def agrees(self) -> bool:
        return self.verdict.startswith("agrees")

    @property
    def relative_difference(self) -> float:
        """churnsim / paper − 1 for a value, of the gains for a speed-up (the larger of the two ends of a
        range); NaN otherwise."""
        if self.churnsim_value is None or self.comparison in ("not_checked",):
            return math.nan
        if isinstance(self.paper_value, tuple) and isinstance(self.churnsim_value, tuple):
            ends = [_relative(c - 1.0, p - 1.0) for c, p in zip(self.churnsim_value, self.paper_value)]
            return max(ends, key=lambda value: abs(value) if math.isfinite(value) else math.inf)
        if isinstance(self.paper_value, (int, float)) and isinstance(self.churnsim_value, (int, float)):
            if self.comparison == "speedup":
                return _relative(self.churnsim_value - 1.0, self.paper_value - 1.0)
            return _relative(self.churnsim_value, self.paper_value)
        return math.nan

    def row(self) -> dict[str, object]:
        def ends(value) -> tuple[float, float]:
            if isinstance(value, tuple):
                return float(value[0]), float(value[1])
            return (math.nan if value is None else float(value)), math.nan

        paper_low, paper_high = ends(self.paper_value)
        churnsim_low, churnsim_high = ends(self.churnsim_value)
        return {
            "id": self.id,
            "claim": self.claim,
            "source": self.source,
            "setting": self.setting,
            "paper": self.paper_text,
            "churnsim": self.churnsim_text,
            "verdict": self.verdict,
            "why": self.why,
            "preset": self.preset,
            "paper_value": paper_low,
            "paper_value_high": paper_high,
            "churnsim_value": churnsim_low,
            "churnsim_value_high": churnsim_high,
            "relative_difference": self.relative_difference,
        }


def _relative(churnsim: float, paper: float) -> float:
    if not (math.isfinite(churnsim) and paper):
        return math.inf if churnsim == math.inf else math.nan
    return churnsim / paper - 1.0


def agreement(churnsim: float, paper: float, *, speedup: bool = False) -> str:
    """"agrees within 10 %", "agrees within 25 %" or "disagrees (+x %)" for one value (of the gain,
    speed-up − 1, when `speedup`)."""
    relative = _relative(churnsim - 1.0, paper - 1.0) if speedup else _relative(churnsim, paper)
    if math.isnan(relative):
        return "not checked (no churnsim number)"
    for level in AGREEMENT_LEVELS:
        if abs(relative) <= level:
            return f"agrees within {level:.0%}".replace("%", " %")
    if math.isinf(relative):
        return "disagrees (churnsim: unbounded)"
    return f"disagrees ({relative:+.0%})".replace("%", " %")


def verdict_of(comparison: Comparison, paper, churnsim) -> str:
    if comparison == "not_checked":
        return "not checked"
    if churnsim is None:
        return "not checked (no churnsim number)"
    if comparison == "input":
        return f"fitted: {agreement(churnsim, paper)}"
    if comparison == "at_least":
        if math.isnan(churnsim):
            return "not checked (no churnsim number)"
        return "agrees" if churnsim >= paper else "disagrees"
    if comparison == "range":
        ends = [agreement(c, p, speedup=True) for c, p in zip(churnsim, paper)]
        if all(end.startswith("agrees") for end in ends):
            return "agrees within 25 %" if any(end.endswith("25 %") for end in ends) else "agrees within 10 %"
        parts = [f"{name} end {end.removeprefix('disagrees (').rstrip(')')}" if end.startswith("disagrees") else f"{name} end {end}"
                 for name, end in zip(("low", "high"), ends)]
        return "disagrees (" + "; ".join(parts) + ")"
    return agreement(churnsim, paper, speedup=comparison == "speedup")


@dataclass(frozen=True, kw_only=True)
class Reproduction:
    """What `churnsim reproduce PAPER` found: the claims, supporting tables and notes."""

    paper: str
    """"checkfree" or "datastates"."""
    title: str
    citation: str
    claims: tuple[Claim, ...]
    tables: dict[str, pd.DataFrame]
    """Supporting tables by file stem (written as CSV beside the report)."""
    setup: tuple[str, ...]
    """How churnsim's numbers were made: presets, replications, assumptions."""
    notes: tuple[str, ...] = ()

    def claims_table(self) -> pd.DataFrame:
        return pd.DataFrame([claim.row() for claim in self.claims], columns=list(CLAIM_COLUMNS))

    def counts(self) -> dict[str, int]:
        verdicts = [claim.verdict for claim in self.claims]
        return {
            "claims": len(verdicts),
            "agree": sum(v.startswith("agrees") for v in verdicts),
            "fitted": sum(v.startswith("fitted") for v in verdicts),
            "disagree": sum(v.startswith("disagrees") for v in verdicts),
            "not_checked": sum(v.startswith("not checked") for v in verdicts),
        }


def format_seconds(value: float) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:,.0f} s"


def format_ratio(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "—"
    if math.isinf(value):
        return "∞"
    return f"{value:.2f}×"


__all__ = ["AGREEMENT_LEVELS", "CLAIM_COLUMNS", "Claim", "Reproduction", "agreement", "format_ratio", "format_seconds", "verdict_of"]
