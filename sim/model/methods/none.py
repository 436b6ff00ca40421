"""`none`: failures are ignored; the no-failure reference curve (DESIGN.md section 2)."""

from __future__ import annotations

from typing import Generator

from .base import RecoveryPolicy


class NonePolicy(RecoveryPolicy):
    """Training never stops: the run model records each failure as `ignored` and does not interrupt."""

    name = "none"

    def on_failures(self, context, failures) -> Generator:
        for event in failures:  # not reached (the config's ignores_failures trait); kept for completeness
            context.record_failure(event, "ignored")
        return
        yield
