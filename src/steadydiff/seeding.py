"""Deterministic seeds derived from progress, so a resumed run replays the same randomness.

Every random draw of the training step (timesteps, noise, label dropout) comes from a
generator seeded by ``derive_seed(seed, step, micro, rank)``, as EDM2 reseeds from progress:
there is no generator state to save, and a batch can be replayed exactly later.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts])
               .generate_state(1, np.uint64)[0] >> 1)


def generator(device: torch.device | str, *parts: int) -> torch.Generator:
    """A fresh torch generator on ``device`` seeded from ``parts``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) global RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
