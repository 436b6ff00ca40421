"""`none`: failures are ignored; the stage keeps its weights and optimizer state.

This gives the no-failure reference curve with the failure schedule still recorded, so a run with
`none` and a run with another method can share one schedule.
"""

from __future__ import annotations

from typing import ClassVar

from .base import RecoveryMethod, RecoveryOutcome


class NoneMethod(RecoveryMethod):
    name: ClassVar[str] = "none"

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        return RecoveryOutcome(
            failed_stages=failed_stages,
            rebuilt_from={stage: "kept (failure ignored)" for stage in failed_stages},
        )
