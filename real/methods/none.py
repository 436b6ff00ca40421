"""`none`: failures are ignored; the stage keeps its weights and optimizer state.

This gives the no-failure reference curve with the failure schedule still recorded, so a run with
`none` and a run with another method can share one schedule. Under hard failures the injector
therefore kills nothing for `none`; a process killed from outside cannot keep its state, and `none`
keeps no copy anywhere: its replacement goes on from fresh random weights.
"""

from __future__ import annotations

from typing import ClassVar

from .base import RecoveryMethod, RecoveryOutcome


class NoneMethod(RecoveryMethod):
    name: ClassVar[str] = "none"

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        killed = self.context.killed_stages
        return RecoveryOutcome(
            failed_stages=failed_stages,
            rebuilt_from={
                stage: "random init (its process was killed; none keeps no copy)" if stage in killed else "kept (failure ignored)"
                for stage in failed_stages
            },
        )
