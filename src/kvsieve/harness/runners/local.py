"""Cells in this process, one after the other, on a model already loaded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .protocol import C, R, Work


@dataclass
class LocalRunner:
    """Runs every cell here on `model` (and `tokenizer`, for protocols that read or write text)."""

    model: torch.nn.Module
    tokenizer: Any = None

    def map(self, work: Work[C, R], cells: Sequence[C]) -> Iterator[R]:
        for cell in cells:
            yield work(self.model, self.tokenizer, cell)
