"""Commands that run real PyTorch pipelines: `real run` and `calibrate` (they import torch lazily)."""

from __future__ import annotations
