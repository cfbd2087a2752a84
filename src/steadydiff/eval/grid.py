"""Sample grids and sample arrays on disk."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, H, W, C) uint8."""
    x = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def grid_nrow(num: int, num_classes: int = 0) -> int:
    """Images per grid row: one column per class for conditional samples, else square."""
    return min(num_classes, num) if num_classes else int(math.ceil(math.sqrt(num)))


def make_grid(x: torch.Tensor, nrow: int | None = None, pad: int = 1) -> np.ndarray:
    """Tile (N, C, H, W) images in [-1, 1] into one (rows*H, nrow*W, C) uint8 array."""
    imgs = to_uint8(x)
    n, h, w, c = imgs.shape
    nrow = nrow or int(math.ceil(math.sqrt(n)))
    rows = int(math.ceil(n / nrow))
    grid = np.zeros((rows * (h + pad) + pad, nrow * (w + pad) + pad, c), np.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h,
             pad + col * (w + pad): pad + col * (w + pad) + w] = imgs[i]
    return grid


def save_grid(x: torch.Tensor, path: str | Path, nrow: int | None = None,
              upscale: int | None = None) -> Path:
    """Save a PNG grid of (N, C, H, W) images in [-1, 1]. Small images are upscaled
    (nearest) so a 16x16 grid is readable in a browser. Returns the path."""
    grid = make_grid(x, nrow)
    img = Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid)
    scale = upscale or max(1, 64 // x.shape[-1])
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    from ..files import atomic_output

    path = Path(path)
    with atomic_output(path) as tmp:
        img.save(tmp, format="PNG")
    return path


def save_npz(x: torch.Tensor, path: str | Path, labels: torch.Tensor | None = None) -> Path:
    """Save ``samples`` (N, C, H, W) float32 in [-1, 1] (and ``labels``) to an .npz file."""
    arrays = {"samples": x.detach().float().clamp(-1, 1).cpu().numpy().astype(np.float32)}
    if labels is not None:
        arrays["labels"] = labels.cpu().numpy().astype(np.int64)
    from ..files import atomic_output

    path = Path(path)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return path
