"""What stops a closed-form run's wait (`Interrupted`) and what sends the whole run to the event model
(`NeedsEventModel`); shared by the run (`engine.py`) and its links (`transfers.py`)."""

from __future__ import annotations


class Interrupted(Exception):
    """A failure or the deadline stopped the trainer's wait or chunk (the event model's `Interrupt`)."""


INTERRUPTED = Interrupted()  # raised for every interrupt (it carries nothing), its traceback cleared each time


class NeedsEventModel(Exception):
    """The run reached a case its closed form does not re-time exactly: simulate it in the event model."""
