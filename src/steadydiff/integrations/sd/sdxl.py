"""SDXL's conditioning (Podell et al. 2023, §2.1-2.2) packed into one tensor ``y``.

The SDXL UNet takes three conditions, as diffusers' ``StableDiffusionXLPipeline`` builds
them (``encode_prompt``, ``_get_add_time_ids``):

- ``encoder_hidden_states`` (N, L, D1 + D2): the penultimate hidden state
  (``hidden_states[-2]``) of each text encoder, concatenated on the feature axis
  (CLIPTextModel 768 + CLIPTextModelWithProjection 1280 = 2048);
- ``text_embeds`` (N, P): the second encoder's projected pooled output (1280);
- ``time_ids`` (N, 6): the micro-conditioning ``original (h, w), crop top-left (top, left),
  target (h, w)`` of each image (``steadydiff.data.buckets.Crop.time_ids``).

Every sampler, the guidance null condition, the cache and the guard take the condition as
one tensor, so the three travel packed in ``y`` and :class:`SDDenoiser
<steadydiff.integrations.sd.model.SDDenoiser>` unpacks them:

    y (N, L + R + 1, D)   rows 0..L-1 the hidden states, the next R = ceil(P / D) rows the
                          pooled embedding (zero-padded to R * D), the last row the six
                          time ids in its first six columns (the rest zeros)

and, when the text encoders train (their token ids are the condition),

    y (N, L1 + L2 + 6) int64   tokenizer 1's ids, tokenizer 2's ids, the six time ids.

A time-ids slot of zeros (a target size of 0 cannot be real) means "this sample's own size,
uncropped": the model fills in ``(H, W, 0, 0, H, W)`` from the latent's shape, which is what
the pipeline uses when it draws at a size (validation prompts, ``steadydiff sample``). The
null condition of classifier-free guidance replaces the text rows only and keeps the
sample's time ids, as diffusers does (``negative_add_time_ids = add_time_ids``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["TIME_IDS", "SDXLLayout", "encode_sdxl", "default_time_ids"]

TIME_IDS = 6  # original (h, w), crop (top, left), target (h, w)


def encode_sdxl(text_encoder: nn.Module, text_encoder_2: nn.Module, ids: Tensor,
                ids_2: Tensor) -> tuple[Tensor, Tensor]:
    """Both encoders' penultimate hidden states concatenated (N, L, D1 + D2) and the second
    encoder's pooled projection (N, P), as ``StableDiffusionXLPipeline.encode_prompt`` (no
    attention mask, clip_skip None)."""
    h1 = text_encoder(ids, output_hidden_states=True).hidden_states[-2]
    out2 = text_encoder_2(ids_2, output_hidden_states=True)
    return torch.cat([h1, out2.hidden_states[-2]], dim=-1), out2[0]


def default_time_ids(h: int, w: int, n: int, device: torch.device | str) -> Tensor:
    """(n, 6) float32 ``(h, w, 0, 0, h, w)``: an uncropped image drawn at its own size.
    Filled on ``device`` (no host-to-device copy: it runs in every step)."""
    out = torch.zeros(n, TIME_IDS, device=device)
    for col, v in ((0, h), (1, w), (4, h), (5, w)):
        out[:, col] = v
    return out


@dataclass(frozen=True)
class SDXLLayout:
    """Where each part of SDXL's condition sits in ``y`` (see the module docstring).

    Attributes:
        text_len: L, the tokenizers' length (77). width: D, the context width (D1 + D2).
        pooled_dim: P. ids_len: (L1, L2), each tokenizer's length (token-id conditions).
        force_zeros: the pipeline's ``force_zeros_for_empty_prompt``: the null condition's
            text part is zeros (else the encoded empty prompt).
    """

    text_len: int
    width: int
    pooled_dim: int
    ids_len: tuple[int, int]
    force_zeros: bool = True

    @property
    def pooled_rows(self) -> int:
        return math.ceil(self.pooled_dim / self.width)

    @property
    def text_rows(self) -> int:
        """Rows of y that hold text (hidden states + pooled): what the null condition
        replaces."""
        return self.text_len + self.pooled_rows

    @property
    def text_ids(self) -> int:
        return self.ids_len[0] + self.ids_len[1]

    def pack(self, embeds: Tensor, pooled: Tensor, time_ids: Tensor | None = None) -> Tensor:
        """(N, L, D), (N, P)[, (N, 6)] -> y (N, L + R + 1, D) float32 (time ids None: the
        zero slot, "the sample's own size")."""
        n, d = embeds.shape[0], self.width
        rows = torch.zeros(n, self.pooled_rows * d + d, dtype=torch.float32,
                           device=embeds.device)
        rows[:, :self.pooled_dim] = pooled.float()
        if time_ids is not None:
            rows[:, self.pooled_rows * d:self.pooled_rows * d + TIME_IDS] = time_ids.float()
        return torch.cat([embeds.float(), rows.view(n, self.pooled_rows + 1, d)], dim=1)

    def unpack(self, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """y (N, L + R + 1, D) -> hidden states (N, L, D), pooled (N, P), time ids (N, 6)."""
        n = y.shape[0]
        pooled = y[:, self.text_len:self.text_rows].reshape(n, -1)[:, :self.pooled_dim]
        return y[:, :self.text_len], pooled, y[:, -1, :TIME_IDS]

    def unpack_ids(self, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """y (N, L1 + L2 + 6) int64 -> ids 1 (N, L1), ids 2 (N, L2), time ids (N, 6)."""
        l1 = self.ids_len[0]
        return y[:, :l1], y[:, l1:self.text_ids], y[:, self.text_ids:]

    def rows_of(self, y: Tensor) -> int:
        """How many leading entries of the condition ``y`` are text (float or token ids)."""
        return self.text_rows if y.is_floating_point() else self.text_ids

    @staticmethod
    def fill_time_ids(time_ids: Tensor, h: int, w: int) -> Tensor:
        """``time_ids`` (N, 6) with every zero slot (target size 0) replaced by
        :func:`default_time_ids` at (h, w); no host sync (a select, not a branch)."""
        unset = (time_ids[:, 4:6] == 0).all(dim=1, keepdim=True)  # (N, 1)
        return torch.where(unset, default_time_ids(h, w, time_ids.shape[0], time_ids.device),
                           time_ids.float())


def item_time_ids(dataset, image_size: int, center_crop: bool) -> Tensor:
    """(N, 6) float32: each item's ``add_time_ids`` from the crop the data pipeline made.

    A bucketed dataset (``data.buckets``): its recorded crop
    (:func:`steadydiff.data.buckets.time_ids`). Otherwise, for an item with an image file:
    its size (EXIF rotation applied) and the ``data.center_crop`` the folder does (the
    shorter side resized to S and the centre square kept: :func:`plan_crop` onto S x S, the
    same arithmetic), or, squashed to S x S without a crop, ``(h, w, 0, 0, S, S)``. An item
    without a file (a user's in-memory dataset): ``(S, S, 0, 0, S, S)``. Reads image
    headers only (~0.1 ms a file), once, before training.
    """
    from ...data import ImageFolderDataset, source_of
    from ...data.buckets import bucket_layout, plan_crop, time_ids

    n = len(dataset)
    if bucket_layout(dataset) is not None:
        return time_ids(dataset, range(n))
    s = image_size
    rows = []
    for i in range(n):
        path = source_of(dataset, i)
        if path is None:
            rows.append((s, s, 0, 0, s, s))
            continue
        w, h = ImageFolderDataset._size(Path(path))
        rows.append(plan_crop(w, h, (s, s)).time_ids() if center_crop else (h, w, 0, 0, s, s))
    return torch.tensor(rows, dtype=torch.float32).reshape(n, TIME_IDS)
