"""Textual inversion (Gal et al. 2022): new tokens whose input embeddings alone train.

``adapter.kind: embedding`` (alias ``textual_inversion``) adds ``adapter.token`` (and, for
``adapter.num_vectors`` = n > 1, ``<token>_1`` ... ``<token>_{n-1}``, diffusers' naming) to
every tokenizer of the family (SD 1.x/2.x: one CLIP; SDXL: CLIP-L and OpenCLIP-G), each
vector starting at ``adapter.init_token``'s embedding. The text encoders run in the step;
every weight of the model stays frozen and bit-identical: the new rows are a separate fp32
parameter (``<part>.<...>.embeddings.token_embedding.ti_rows``, (n, width)) that the
encoder's token embedding reads for the new ids, the original table untouched (not even
resized). The guard sees them as the run's trainable parameters (non-finite -> rollback,
exact resume through the checkpoint).

A prompt's ``token`` is expanded to the n vectors' tokens before tokenizing (what
diffusers' ``maybe_convert_prompt`` does after ``load_textual_inversion``).

Files written at every save (only finite embeddings), the latest and numbered copies
(numbered.py)::

    RUN/embeddings/<token>.safetensors          A1111 / ComfyUI: emb_params (n, 768|1024),
                                                SDXL: clip_l (n, 768), clip_g (n, 1280)
    RUN/embeddings/learned_embeds.safetensors   diffusers: {token: (n, width)} (first encoder)
    RUN/embeddings/learned_embeds_2.safetensors diffusers, SDXL's second encoder
        pipe.load_textual_inversion("RUN/embeddings/learned_embeds.safetensors")
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...trainer.checkpoint import Checkpoint, CheckpointError
from .model import _SDWeights, _trainable
from .numbered import mark_best, numbered_files, prune, publish

__all__ = ["TokenRows", "add_embedding", "token_names", "expand_prompt", "EmbeddingWeights",
           "embedding_files", "EMB_FOLDER", "DIFFUSERS_FILE"]

EMB_FOLDER = "embeddings"
DIFFUSERS_FILE = "learned_embeds"  # + "_2" for the second encoder (diffusers' SDXL script)
ROWS = "ti_rows"
# A1111's SDXL embedding keys, by the encoder's width order in the family (CLIP-L, then G)
SDXL_KEYS = ("clip_l", "clip_g")
_SAFE_TOKEN = re.compile(r"^[^\s/\\:*?\"|]+$")


class TokenRows(nn.Embedding):
    """A CLIP token embedding with trainable rows for new token ids: ids ``first`` ...
    ``first + n - 1`` read ``ti_rows`` (fp32, trainable); every other id reads the frozen
    table ``weight`` as before. Made by :func:`add_token_rows` (the module's class is
    switched in place, so the table keeps its name and its storage)."""

    first: int

    def forward(self, ids: Tensor) -> Tensor:  # type: ignore[override]
        rows: Tensor = getattr(self, ROWS)
        new = (ids >= self.first) & (ids < self.first + rows.shape[0])
        out = super().forward(torch.where(new, torch.zeros_like(ids), ids))
        picked = rows[(ids - self.first).clamp(0, rows.shape[0] - 1)].to(out.dtype)
        return torch.where(new[..., None], picked, out)


def add_token_rows(emb: nn.Embedding, first: int, init: Tensor) -> TokenRows:
    """Switch ``emb`` to :class:`TokenRows` with rows ``init`` (n, width) from id ``first``."""
    emb.__class__ = TokenRows
    emb.first = int(first)
    emb.register_parameter(ROWS, nn.Parameter(init.detach().float().clone(),
                                              requires_grad=True))
    return emb  # type: ignore[return-value]


def token_names(token: str, n: int) -> list[str]:
    """The tokens of an n-vector embedding: ``token``, ``token_1`` ... (diffusers')."""
    return [token] + [f"{token}_{i}" for i in range(1, n)]


def expand_prompt(prompt: str, token: str, n: int) -> str:
    """``token`` in ``prompt`` -> its n vectors' tokens (n > 1), as diffusers' pipelines."""
    return prompt if n == 1 else prompt.replace(token, " ".join(token_names(token, n)))


def _embedding_module(te: nn.Module) -> nn.Embedding:
    emb = te.get_input_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"{type(te).__name__} has no token embedding table to extend")
    return emb


def add_embedding(tokenizers: list[Any], text_encoders: list[nn.Module], *, token: str,
                  init_token: str | None, num_vectors: int, family: str) -> list[int]:
    """Add ``token``'s vectors to every tokenizer and their trainable rows to every text
    encoder (frozen otherwise). Returns each encoder's first new id.

    Raises:
        ValueError: a text encoder is not a CLIP (the family is not SD 1.x/2.x or SDXL), the
            token is in a tokenizer already or names no file, the init token is not one
            token.
    """
    for te in text_encoders:
        if not type(te).__name__.startswith("CLIPText"):
            raise ValueError(f"adapter.kind=embedding trains new token embeddings of CLIP text "
                             f"encoders (Stable Diffusion 1.x/2.x, SDXL); the {family} has a "
                             f"{type(te).__name__}: use adapter.kind=lora")
    if not _SAFE_TOKEN.match(token):
        raise ValueError(f"adapter.token={token!r}: a token is one word without spaces, "
                         "slashes or any of :*?\"| (it names the embedding file); e.g. <sks>")
    names = token_names(token, num_vectors)
    firsts = []
    for i, (tok, te) in enumerate(zip(tokenizers, text_encoders)):
        vocab = tok.get_vocab()
        have = [n for n in names if n in vocab or n.lower() in vocab
                or n + "</w>" in vocab or n.lower() + "</w>" in vocab]
        if have:
            raise ValueError(f"adapter.token={token!r}: {have[0]!r} is already a token of "
                             f"tokenizer {i + 1}; choose a new word (e.g. <{token.strip('<>')}-"
                             "ti>) so only the new embedding carries the concept")
        emb = _embedding_module(te)
        if init_token:
            ids = tok(init_token, add_special_tokens=False).input_ids
            if len(ids) != 1:
                raise ValueError(f"adapter.init_token={init_token!r} is {len(ids)} tokens for "
                                 f"tokenizer {i + 1} ({tok.convert_ids_to_tokens(ids)}); it "
                                 "must be one token (a common single word such as 'dog', "
                                 "'person', 'style')")
            start = emb.weight[ids[0]].detach().float()
        else:  # the mean of the table, as A1111's "*" initialisation approximates
            start = emb.weight.detach().float().mean(0)
        before = len(tok)
        added = tok.add_tokens(names)
        if added != len(names):
            raise ValueError(f"adapter.token={token!r}: tokenizer {i + 1} did not add it as "
                             "a new token")
        first = tok.convert_tokens_to_ids(names[0])
        if first != before or tok.convert_tokens_to_ids(names[-1]) != before + len(names) - 1:
            raise ValueError(f"tokenizer {i + 1} gave {token!r} non-consecutive ids")
        te.requires_grad_(False)
        add_token_rows(emb, first, start.expand(len(names), -1))
        firsts.append(first)
    return firsts


def embedding_tensors(model: nn.Module) -> list[Tensor]:
    """The trained rows of each text encoder in the model (the family's order)."""
    return [getattr(_embedding_module(te), ROWS) for te in model.text_encoders]


def embedding_files(vectors: list[Tensor], out: Path, token: str) -> dict[Path, str]:
    """Write the A1111/ComfyUI file ``out/<token>.safetensors`` and diffusers'
    ``learned_embeds[_2].safetensors``; returns ``{file: its numbered stem}``.

    Raises:
        CheckpointError: a vector is non-finite (nothing is written).
    """
    from safetensors.torch import save_file

    from ...files import atomic_output

    vecs = [v.detach().to("cpu", torch.float32).contiguous() for v in vectors]
    for i, v in enumerate(vecs):
        if not torch.isfinite(v).all():
            raise CheckpointError(f"the embedding of text encoder {i + 1} has non-finite "
                                  "values: not written")
    a1111 = ({"emb_params": vecs[0]} if len(vecs) == 1 else
             dict(zip(SDXL_KEYS, vecs)))
    out.mkdir(parents=True, exist_ok=True)
    files: dict[Path, str] = {}
    meta = {"format": "a1111-embedding", "name": token, "vectors": str(vecs[0].shape[0])}
    path = out / f"{token}.safetensors"
    with atomic_output(path) as tmp:
        save_file(a1111, str(tmp), metadata=meta)
    files[path] = token
    for i, v in enumerate(vecs):
        stem = DIFFUSERS_FILE + ("" if i == 0 else f"_{i + 1}")
        path = out / f"{stem}.safetensors"
        with atomic_output(path) as tmp:
            save_file({token: v}, str(tmp))
        files[path] = stem
    return files


class EmbeddingWeights(_SDWeights):
    """A textual-inversion run: checkpoints hold the new rows (and their EMA); exports
    write ``RUN/embeddings/`` (module docstring)."""

    def __init__(self, cfg: Any, base: Path, firsts: list[int]) -> None:
        self.cfg, self.base, self.firsts = cfg, base, firsts

    def tensors(self, state: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        own = _trainable(state.model)
        ema = dict(state.ema.module.named_parameters())
        return {n: p.detach() for n, p in own.items()}, {n: ema[n].detach() for n in own}

    def restore(self, state: Any, c: Checkpoint) -> None:
        own = _trainable(state.model)
        ema = dict(state.ema.module.named_parameters())
        for what, saved in (("model", c.model), ("EMA", c.ema)):
            if set(saved) != set(own) or any(saved[n].shape != p.shape for n, p in own.items()):
                raise CheckpointError(
                    f"{c.path}: its embedding {what} tensors do not match this run's "
                    "(adapter.num_vectors or model.pretrained changed since it was written)")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(c.model[n])
                ema[n].copy_(c.ema[n])

    def info(self) -> dict[str, Any]:
        return {"kind": "embedding", "base": str(self.base), "token": self.cfg.token,
                "init_token": self.cfg.init_token, "num_vectors": self.cfg.num_vectors,
                "first_ids": list(self.firsts)}

    def export(self, state: Any, root: Path, final: bool) -> Path | None:
        model = state.ema.module if state.cfg.sample.use_ema else state.model
        folder = root / EMB_FOLDER
        files = self.write(model, state.cfg, state.step, state.precision, folder, root.name)
        publish(files, folder, state.step)  # <stem>-stepNNNNNNNN.safetensors
        prune(folder, set(files.values()), state.cfg.adapter.keep_files)
        return next(iter(files))

    def mark_best(self, state: Any, root: Path, info: dict[str, Any]) -> Path | None:
        folder, stems = root / EMB_FOLDER, self.stems(state.cfg, root.name)
        have = numbered_files(folder, stems).get(state.step)
        if not have:
            self.export(state, root, False)
            have = numbered_files(folder, stems).get(state.step, [])
        return mark_best(folder, state.step, have, info)

    def stems(self, cfg: Any, name: str) -> dict[str, str]:
        out = {cfg.adapter.token: "a1111"}
        for i in range(len(self.firsts)):
            out[DIFFUSERS_FILE + ("" if i == 0 else f"_{i + 1}")] = "diffusers"
        return out

    def write(self, model: nn.Module, cfg: Any, step: int, precision: str, out: Path,
              name: str) -> dict[Path, str]:
        return embedding_files(embedding_tensors(model), out, cfg.adapter.token)
