"""The latent and text-embedding cache for latent-space and text-conditioned training.

A latent-space model (Stable Diffusion style, Rombach et al. 2022) trains on the frozen VAE's
latents, and a text-conditioned one on the frozen text encoder's embeddings. Both are fixed
functions of the data, so they are computed once, before training, and kept on disk:

    cache_dir/
      latents/<key[:2]>/<key>.safetensors   one tensor "latent" (c, h, w) float32
      text/<key[:2]>/<key>.safetensors      one tensor "context" (L, D) float32

    latent key  = sha256 of (the image file's sha256 (or, for a dataset without files, of the
                  image tensor's bytes), ``prep``, ``encoder_id``; for a bucketed dataset,
                  ``data.buckets``, also the image's bucket size and crop)
    text key    = sha256 of (the caption, ``encoder_id``)

The key is a function of everything the value depends on, so a changed image file, another
preprocessing (``prep``) or different encoder weights (``encoder_id``, see
:func:`module_identity`) simply miss: nothing is ever invalidated by hand, and stale entries
are only dead files. Each file also carries its key in the safetensors metadata.

Nothing in the cache is trusted: a file that does not load (truncated by a killed run, a
full disk, a stray edit), holds the wrong dtype or shape, another key, or a non-finite value
is a miss and is overwritten. Files are written atomically (a temporary file in the same
folder, fsync, ``os.replace``), so a reader sees the old file or the new one, never half of
one; two processes writing one key write the same bytes and the last rename wins.

Every latent is checked finite when encoded and when loaded. An fp16 VAE overflows on some
images (the "NaN detected in latents" of kohya-ss/sd-scripts #653): such a sample is encoded
again, alone, with ``fallback`` (the fp32 VAE); if that is finite it is kept (and cached), else
the sample is quarantined: reported, with its file, and left out of training. A bad sample
never raises and a non-finite latent is never returned nor written.

This module does not import diffusers or transformers: the caller passes ``encode`` callables
and identity strings, so it is testable with any module and costs nothing to import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.utils.data import Dataset

from steadydiff.data import DataError, source_of
from steadydiff.data.buckets import BucketLayout, bucket_layout
from steadydiff.data.pairs import conditioning_of, pair_name

__all__ = ["CachingStopped", "check_cache_dir", "module_identity", "file_digest", "encode_latents", "encode_texts",
           "encode_conditioning", "append_rows", "LatentResult", "TextResult",
           "ConditioningResult", "EncodedDataset"]

log = logging.getLogger(__name__)

# The format tag enters every key: changing what a cache file means (another layout, another
# dtype) is a new tag, and every old entry then misses instead of being misread.
_FORMAT = "steadydiff-cache/1"
_CHUNK = 1 << 20  # bytes read at a time when hashing a file


# --------------------------------------------------------------------------- identities


def _sha(*parts: str) -> str:
    """sha256 of a JSON list: unambiguous where plain concatenation is not ("ab"+"c" vs
    "a"+"bc")."""
    return hashlib.sha256(json.dumps([_FORMAT, *parts]).encode()).hexdigest()


def _config_dict(module: torch.nn.Module) -> dict[str, Any] | None:
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    to_dict = getattr(cfg, "to_dict", None)
    d = to_dict() if callable(to_dict) else cfg
    if not isinstance(d, dict):
        return None
    # Keys starting with "_" are bookkeeping, not math: where the module was loaded from
    # (_name_or_path), the library version that saved it (_diffusers_version), which defaults
    # were used. Keeping them would make the same weights read from two folders two encoders.
    return {k: v for k, v in d.items()
            if not str(k).startswith("_") and k != "transformers_version"}


def module_identity(module: torch.nn.Module, extra: dict[str, Any] | None = None) -> str:
    """A sha256 hex naming what ``module`` computes, for cache keys (``encoder_id``).

    Hashed: the class name, the module's ``config`` when it has one (diffusers and
    transformers modules: its dict form, as JSON with sorted keys, bookkeeping keys starting
    with "_" left out), ``extra`` (JSON, sorted keys: put there what the weights do not say
    but the output depends on, e.g. ``{"dtype": "fp16", "latent": "mean", "scale": 0.18215}``),
    and every ``state_dict`` tensor (parameters and persistent buffers) in name order: its
    name, dtype, shape and bytes as stored (fp16/bf16 unconverted), copied to the CPU.

    Same weights and config give the same id on any machine; one changed element gives
    another. Cost: one sha256 pass over the weights, ~1 s per GB (a full SD VAE, 84 M fp32
    parameters: ~335 MB hashed in ~0.4 s), once per run; plus the copy to the CPU for a module
    on a GPU.

    Args:
        module: the frozen encoder (VAE, text encoder, or anything else).
        extra: more JSON-able facts to hash along (None: nothing).

    Returns:
        64 lowercase hex digits.
    """
    h = hashlib.sha256()
    head = {"format": _FORMAT, "class": type(module).__name__,
            "config": _config_dict(module), "extra": extra}
    # default=str: configs hold tuples (JSON lists), paths, dtypes; their text is stable.
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    state = module.state_dict()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):  # extra_state objects: hash their text
            h.update(json.dumps([name, repr(t)]).encode())
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        # The raw bytes through a uint8 view: works for every dtype, bf16 included, no copy.
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 hex of a file's bytes, read in 1 MB chunks (never all in memory).

    Raises:
        DataError: the file cannot be read; the message names it.
    """
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as e:
        raise DataError(f"{path}: cannot read the file to hash it for the cache ({e})") from None
    return h.hexdigest()


def _tensor_digest(x: torch.Tensor) -> str:
    x = x.detach().to("cpu").contiguous()
    h = hashlib.sha256(json.dumps([str(x.dtype), list(x.shape)]).encode())
    h.update(x.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


class CachingStopped(Exception):
    """Encoding stopped on request (a stop signal, trainer/preempt.py) before every item was
    cached. Each entry written is complete and verified on its next read; the next run
    encodes only the rest.

    Attributes:
        what: ``latents``, ``text`` or ``conditioning``.
        done: items encoded by this call before it stopped; ``left``: items still to do.
    """

    def __init__(self, what: str, done: int, left: int) -> None:
        self.what, self.done, self.left = what, done, left
        super().__init__(f"stopped while caching {what}: {done} encoded in this run, "
                         f"{left} left for the next one (every entry written is complete)")


# --------------------------------------------------------------------------- the store

# A temporary cache file older than this whose writer cannot be checked (another host, or an
# unreadable name) is taken for the leftover of a killed run and removed.
STALE_TMP_S = 24 * 3600
_HOST = socket.gethostname().replace(".", "_").replace("-", "_") or "host"


class _Store:
    """One folder of ``<key[:2]>/<key>.safetensors`` files, one named tensor each."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def load(self, key: str, ndim: int, dtype: torch.dtype = torch.float32
             ) -> torch.Tensor | None:
        """The cached tensor, or None for any reason not to trust it (absent, unreadable,
        truncated, another key, not ``dtype``, not ``ndim``-D, not finite)."""
        p = self.path(key)
        try:
            data = p.read_bytes()
        except OSError:  # absent (the usual miss) or unreadable
            return None
        try:
            # A cache file is untrusted input: whatever the parser raises (safetensors'
            # SafetensorError, a bad header's JSON or struct errors) means "miss".
            n = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
            t = st_load(data).get(self.name)
        except Exception:  # noqa: BLE001 - see above
            return None
        if meta.get("key") != key or t is None or t.dtype != dtype or t.ndim != ndim \
                or not bool(torch.isfinite(t).all()):
            return None
        return t

    def save(self, key: str, t: torch.Tensor, meta: dict[str, str]) -> None:
        """Write atomically: temp file in the same folder, fsync, rename over the target."""
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = st_save({self.name: t.contiguous()}, metadata={"key": key, **meta})
        # Hidden, unique name: never taken for an entry, and never shared by two writers; the
        # host and pid say whose it is, so a killed writer's leftover is swept (:meth:`sweep`).
        tmp = p.with_name(f".{p.name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)  # the bytes are on disk before the name points at them
            finally:
                os.close(fd)
            os.replace(tmp, p)
        except OSError as e:
            from ..files import WriteFailed, describe_failure, write_failure

            if write_failure(e) is None:
                raise
            raise WriteFailed(e.errno, describe_failure(p, e)) from None
        finally:
            if tmp.exists():
                tmp.unlink()


    def sweep(self) -> int:
        """Remove the temporaries of writers that are gone: a run killed in the middle of
        :meth:`save` leaves its hidden ``.tmp`` (the entry itself is untouched: the rename
        never happened). A file of this host whose process no longer exists is removed; one
        of another host (a cache shared over a network file system), or of the format of
        earlier versions (no host), once it is older than :data:`STALE_TMP_S`. A live
        writer's file is never touched. Returns the number removed."""
        removed = 0
        try:
            subs = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except OSError:
            return 0  # no store yet
        now = time.time()
        for d in subs:
            try:
                entries = [e for e in os.scandir(d.path)
                           if e.name.startswith(".") and e.name.endswith(".tmp")]
            except OSError:
                continue
            for e in entries:
                owner = e.name[:-4].rsplit(".", 1)[-1].split("-")  # host, pid, token
                try:
                    stale = (_gone(int(owner[1])) if len(owner) == 3 and owner[0] == _HOST
                             else now - e.stat(follow_symlinks=False).st_mtime > STALE_TMP_S)
                    if stale:
                        os.unlink(e.path)
                        removed += 1
                except (OSError, ValueError):
                    continue
        if removed:
            log.info("cache %s: removed %d temporary files left by killed runs", self.root,
                     removed)
        return removed


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` exists on this host."""
    from ..files import pid_alive

    return pid != os.getpid() and not pid_alive(pid)


def check_cache_dir(path: str | os.PathLike[str], key: str = "data.cache_dir") -> Path:
    """``path`` as the cache root, refused (a DataError naming it) when it, or a folder
    above it, is a file: the first write would fail with a bare ``NotADirectoryError``."""
    p = Path(path).expanduser()
    if not str(path).strip():
        raise DataError(f"{key} is empty; give a folder (or null for RUN/cache)")
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            if not q.is_dir():
                what = "is" if q == p else f"lies under {q}, which is"
                raise DataError(f"{key} {str(p)!r} {what} a file, not a folder; give a "
                                f"folder for the cache (it is created if missing), or null "
                                f"for RUN/cache")
            break
    return p


def _printable(name: str) -> str:
    """A file name as UTF-8 text: bytes that are not UTF-8 (kept by Python as surrogates)
    shown as ``\\xNN``."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _check_names(names: Sequence[str | None]) -> None:
    """Refuse a file name that is not valid UTF-8: each cache entry records its source's
    name in its (UTF-8, JSON) metadata, which cannot hold it."""
    for s in names:
        if s is None:
            continue
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{_printable(s)}: the file name is not valid UTF-8 (the bytes "
                            f"shown as \\xNN); the cache records each file's name as UTF-8 "
                            f"text: rename it (e.g. `convmv -f latin1 -t utf-8 --notest "
                            f"FILE`)") from None


def _nonfinite(t: torch.Tensor) -> str:
    """``3 NaN, 0 Inf of 256 elements``."""
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"{nan} NaN, {inf} Inf of {t.numel()} elements"


def _check_batch(z: Any, n: int, what: str) -> torch.Tensor:
    if not isinstance(z, torch.Tensor) or z.ndim != 4 or z.shape[0] != n:
        got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(f"{what} must return a (B, c, h, w) tensor with B={n} (the batch), "
                         f"got {got}")
    return z.detach().to("cpu", torch.float32)


class _Progress:
    """A status line on stderr every 10 s and at the end (``progress=True`` only)."""

    def __init__(self, on: bool, what: str, total: int) -> None:
        self.on, self.what, self.total = on, what, total
        self.last = time.perf_counter()

    def __call__(self, done: int, hits: int, end: bool = False) -> None:
        now = time.perf_counter()
        if self.on and (end or now - self.last >= 10.0):
            self.last = now
            print(f"{self.what}: {done}/{self.total} ({hits} from the cache)", file=sys.stderr,
                  flush=True)


# --------------------------------------------------------------------------- latents


@dataclass
class LatentResult:
    """What :func:`encode_latents` returns.

    The kept latents are one stacked tensor (compact, picklable, indexable without a dict):
    ``latents[k]`` is the latent of dataset item ``index[k]``; ``index`` is ascending.

    Attributes:
        latents: ``(N_kept, c, h, w)`` float32, all finite, on the CPU
            (``(0, c, h, w)`` when every item was quarantined; ``(0, 0, 0, 0)`` for an empty
            dataset); for a bucketed dataset whose buckets give latents of several shapes, a
            list of ``(c, h, w)`` tensors, one per kept item.
        index: the dataset index of each row, ascending.
        total: ``len(dataset)``.
        quarantined: ``{i: {"index": i, "source": path or None, "why": str}}``, the items
            left out: no finite latent could be computed, or the image was unreadable (the
            data set replaced it by another: see ``ImageFolderDataset.fetch``).
        reencoded: ``[{"index", "source", "why"}]``, the items whose latent was non-finite
            from ``encode`` but finite from ``fallback`` (kept, and cached: a later run reads
            them as hits and does not list them again).
        hits, misses: cache entries read / encoded (``misses`` counts every encoded item).
        seconds: the wall time of the call.
    """

    latents: torch.Tensor | list[torch.Tensor]
    index: list[int]
    total: int
    quarantined: dict[int, dict[str, Any]] = field(default_factory=dict)
    reencoded: list[dict[str, Any]] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0

    def without(self, records: dict[int, dict[str, Any]]) -> "LatentResult":
        """This result with the items ``records`` names also quarantined (left out)."""
        drop = set(records) & set(self.index)
        if not drop:
            return self
        keep = [k for k, i in enumerate(self.index) if i not in drop]
        lat = ([self.latents[k] for k in keep] if isinstance(self.latents, list)
               else self.latents[keep])
        return LatentResult(lat, [self.index[k] for k in keep], self.total,
                            {**self.quarantined, **{i: records[i] for i in drop}},
                            self.reencoded, self.hits, self.misses, self.seconds)


def _fetch(dataset: Dataset, i: int) -> tuple[torch.Tensor, bool]:
    """Item ``i``'s image, and whether it was unreadable and replaced by another (datasets
    with a ``fetch`` method, like the image folder, say so; others never are)."""
    fetch = getattr(dataset, "fetch", None)
    x, _, bad = fetch(i) if callable(fetch) else (*dataset[i][:2], False)
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise DataError(f"dataset item {i}: expected an image tensor (C, H, W), got {got}")
    return x, bool(bad)


def encode_latents(dataset: Dataset, encode: Callable[[torch.Tensor], torch.Tensor], *,
                   encoder_id: str, prep: str, cache_dir: Path | str | None,
                   fallback: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   device: torch.device | str | None = None,
                   progress: bool = False,
                   stop: Callable[[], bool] | None = None) -> LatentResult:
    """Every item's latent, read from the cache or encoded (and cached), each checked finite.

    Each image is encoded alone (a batch of one), so its latent is a pure function of its
    key (file, preprocessing, encoder) and of nothing else: a VAE's output for an image
    depends, in the last bits, on what else shares its batch (up to 1.3e-6 between a batch of
    1 and one of 8 for SD's VAE), so batching whatever is still missing would make a cache
    filled in two runs (killed, then resumed) or shared by two data sets differ from one
    filled in one go. One image at a time is also what kohya's ``vae_batch_size`` defaults
    to; the cost is one VAE call per image, once per image ever (then it is a hit).

    Args:
        dataset: ``dataset[i]`` is ``(image (C, H, W) float32 in [-1, 1], anything)``; the
            item's file is ``source_of(dataset, i)`` (a dataset without files is keyed by
            the image tensor's bytes, so every image is loaded once per call to hash it).
        encode: ``(B, C, H, W) float32 on device -> (B, c, h, w)``, already scaled (the
            caller applies the VAE's scaling factor, and picks mean or sample). Called under
            ``torch.no_grad()``; stored as float32.
        encoder_id: names ``encode`` (:func:`module_identity` of the VAE, with its dtype and
            scaling factor in ``extra``).
        prep: the preprocessing that made the image from its file, e.g.
            ``"size=32,crop=center,channels=3"``: another ``prep`` is another entry.
        cache_dir: the cache root (latents go under ``latents/``); None: nothing on disk.
        fallback: encodes one image ``(1, C, H, W)`` again when ``encode`` gave a non-finite
            latent (the fp32 VAE for an fp16 one); None: such items are quarantined.
        device: where images go before ``encode`` (None: stay on the CPU).
        progress: print a status line on stderr every 10 s.
        stop: asked before each image is encoded; True ends the call at once with
            :class:`CachingStopped` (a stop signal): every entry written so far is complete
            and valid, and the next call encodes only what is missing.

    Returns:
        A :class:`LatentResult`. With a cache, hashing every file costs one read of the data
        set per call (the cache is keyed by content, not by name or mtime), and a data set
        without files is loaded once more to hash its images.

    Raises:
        DataError: an item cannot be loaded or hashed (the data module names the file).
        ValueError: ``encode`` broke its contract (not a ``(B, c, h, w)`` tensor, or latents
            of different shapes within one data set).
        CachingStopped: ``stop()`` said so.
    """
    t0 = time.perf_counter()
    n = len(dataset)
    store = (_Store(check_cache_dir(cache_dir) / "latents", "latent")
             if cache_dir is not None else None)
    if store is not None:
        store.sweep()
    sources = [source_of(dataset, i) for i in range(n)]
    if store is not None:
        _check_names(sources)
    # Bucketed data: images of one bucket share a shape (and are encoded together); the key
    # holds the bucket and the crop, so another bucket set or crop is another entry.
    layout = bucket_layout(dataset)
    group = layout.ids if layout is not None else [0] * n
    item_prep = ([f"{prep},bucket={c.target_size[1]}x{c.target_size[0]},"
                  f"crop={c.crop_top_left[0]},{c.crop_top_left[1]}" for c in layout.crops]
                 if layout is not None else [prep] * n)
    # Without a cache nothing is looked up: no file is read twice only to be hashed.
    keys = [_sha("latent",
                 file_digest(s) if s is not None else _tensor_digest(_fetch(dataset, i)[0]),
                 item_prep[i], encoder_id) for i, s in enumerate(sources)] \
        if store is not None else []
    meta = {"encoder_id": encoder_id}

    got: dict[int, torch.Tensor] = {}
    if store is not None:
        for i in range(n):
            t = store.load(keys[i], ndim=3)
            if t is not None:
                got[i] = t
    hits = len(got)
    queue = deque(i for i in range(n) if i not in got)
    res = LatentResult(latents=torch.empty(0), index=[], total=n)
    # (c, h, w) of each group (bucket): fixed by its first fresh encoding
    shapes: dict[int, tuple[int, ...]] = {}
    show = _Progress(progress, "latents", n)

    def keep(i: int, z: torch.Tensor) -> None:
        got[i] = z.clone()  # its own storage: not a view pinning the encoder's output
        if store is not None:
            store.save(keys[i], got[i], {**meta, "prep": item_prep[i],
                                         "source": sources[i] or ""})

    def one(i: int) -> str | None:
        """Encode item ``i`` alone and keep its latent; else why it is left out."""
        x, bad = _fetch(dataset, i)
        if bad:
            # The data set handed over another file's image: caching it under this file's
            # key would train on a duplicate that names the wrong file.
            return "image unreadable, replaced by another by the data set" + (
                f" ({r})" if (r := getattr(dataset, "bad_paths", {}).get(sources[i])) else "")
        x = x[None].to(device=device, dtype=torch.float32)  # (1, C, H, W): alone
        with torch.no_grad():
            z = _check_batch(encode(x), 1, "encode")[0]  # (c, h, w)
        shape = shapes.setdefault(group[i], tuple(z.shape))
        if tuple(z.shape) != shape:
            raise ValueError(f"encode returned a latent {tuple(z.shape)} for dataset item "
                             f"{i} but {shape} for earlier ones: every image of a data set "
                             f"(of a bucket) must have one size (check the preprocessing)")
        res.misses += 1
        if bool(torch.isfinite(z).all()):
            keep(i, z)
            return None
        first = _nonfinite(z)
        if fallback is None:
            return f"latent non-finite ({first}) and no fallback encoder was given"
        with torch.no_grad():
            zf = _check_batch(fallback(x), 1, "fallback")[0]
        if tuple(zf.shape) != shape:
            raise ValueError(f"fallback returned a latent {tuple(zf.shape)} but encode "
                             f"{shape}: it must be the same encoder in another dtype")
        if not bool(torch.isfinite(zf).all()):
            return (f"latent non-finite from encode ({first}) and again from the fallback "
                    f"encoder ({_nonfinite(zf)})")
        keep(i, zf)
        res.reencoded.append({"index": i, "source": sources[i],
                              "why": f"latent non-finite from encode ({first}); finite from "
                                     f"the fallback encoder"})
        return None

    while True:
        if not queue:
            # A cached file of another shape than its group's fresh latents (or, with nothing
            # fresh, than most cached ones) was not written for this key: encode it again.
            for k in sorted({group[i] for i in got} - set(shapes)):
                shapes[k] = Counter(tuple(t.shape) for i, t in got.items()
                                    if group[i] == k).most_common(1)[0][0]
            queue = deque(sorted(i for i, t in got.items()
                                 if tuple(t.shape) != shapes[group[i]]))
            if not queue:
                break
            for i in queue:
                del got[i]
            hits -= len(queue)
            log.warning("latent cache: %d entries have another shape than their bucket's; "
                        "re-encoding", len(queue))
        if stop is not None and stop():
            raise CachingStopped("latents", res.misses, len(queue))
        i = queue.popleft()
        why = one(i)
        if why is not None:
            res.quarantined[i] = {"index": i, "source": sources[i], "why": why}
            log.warning("latent cache: quarantined dataset item %d%s: %s", i,
                        f" ({sources[i]})" if sources[i] else "", why)
        show(len(got) + len(res.quarantined), hits)

    res.index = sorted(got)
    if len({tuple(t.shape) for t in got.values()}) > 1:  # buckets: one tensor per item
        res.latents = [got[i] for i in res.index]
    else:
        res.latents = (torch.stack([got[i] for i in res.index]) if got
                       else torch.empty((0, *next(iter(shapes.values()), (0, 0, 0)))))
    res.hits = hits
    res.seconds = time.perf_counter() - t0
    show(n, hits, end=True)
    return res


# --------------------------------------------------------------------------- text


@dataclass
class TextResult:
    """What :func:`encode_texts` returns.

    Attributes:
        contexts: ``(U, L, D)`` float32, one row per distinct caption, in order of first
            appearance (``captions``).
        captions: the U distinct captions.
        caption_index: ``(N,)`` int64: item ``i``'s embedding is ``contexts[caption_index[i]]``.
        null: ``(L, D)`` float32, the embedding of the empty caption "" (the null condition of
            classifier-free guidance), always computed.
        hits, misses: cache entries read / encoded (the null caption included).
        seconds: the wall time of the call.
        reencoded: the captions whose embedding was non-finite from ``encode_text`` and
            finite from ``fallback`` (kept, and cached).
        bad: ``{caption: why}``, embeddings non-finite from the fallback too (or with no
            fallback): their rows are zeros, and the items that use them are to be left out
            (the caller quarantines them, naming their files).
    """

    contexts: torch.Tensor
    captions: list[str]
    caption_index: torch.Tensor
    null: torch.Tensor
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0
    reencoded: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)


def encode_texts(captions: Sequence[str],
                 encode_text: Callable[[list[str]], torch.Tensor], *,
                 encoder_id: str, cache_dir: Path | str | None,
                 fallback: Callable[[list[str]], torch.Tensor] | None = None,
                 blame: Callable[[str], str] | None = None,
                 stop: Callable[[], bool] | None = None) -> TextResult:
    """Every distinct caption's embedding, encoded once (and cached), plus the null one.

    Each caption is encoded alone, as each latent is (:func:`encode_latents`): its
    embedding is then a function of the caption and the encoder only, whichever captions
    were missing from the cache when it was filled.

    Fashion-MNIST with class-name captions has 60,000 items but a few dozen distinct
    captions: those are what is encoded (or read).

    A non-finite embedding comes from the text encoder, not the image: it overflows its
    dtype (fp16), or a token's embedding row is broken. It is encoded again with
    ``fallback`` (the encoder in fp32, read from disk); finite, it is kept (and cached);
    still non-finite, the caption is in ``bad`` (with ``blame``'s words: the tokens to
    blame) and the caller leaves its items out. The empty caption (the null condition) must
    be finite: without it nothing trains.

    Args:
        captions: one caption per dataset item.
        encode_text: ``list[str] -> (B, L, D)`` float (the caller tokenizes and runs the
            frozen text encoder); called under ``torch.no_grad()``.
        encoder_id: names ``encode_text`` (:func:`module_identity` of the text encoder, with
            the tokenizer's identity and max length in ``extra``).
        cache_dir: the cache root (embeddings go under ``text/``); None: nothing on disk.
        fallback: ``list[str] -> (B, L, D)`` in a higher precision, for the captions whose
            embedding is non-finite; None: they go to ``bad`` directly.
        blame: ``caption -> str``, what in the caption is to blame (its tokens whose
            embedding rows are broken), for ``bad``'s message.
        stop: asked before each caption; True ends the call with :class:`CachingStopped`.

    Raises:
        DataError: a caption that is not a string, or a non-finite embedding of the empty
            caption (naming the encoder's tokens to blame).
        ValueError: ``encode_text`` broke its contract (not a ``(B, L, D)`` tensor, or
            embeddings of different shapes).
        CachingStopped: ``stop()`` said so.
    """
    t0 = time.perf_counter()
    row: dict[str, int] = {}
    index = torch.empty(len(captions), dtype=torch.int64)
    for i, c in enumerate(captions):
        if not isinstance(c, str):
            raise DataError(f"caption of dataset item {i} is {type(c).__name__} {c!r:.40}; "
                            "expected a string")
        index[i] = row.setdefault(c, len(row))
    unique = list(row)
    todo = unique + ([""] if "" not in row else [])  # the null caption rides along
    store = (_Store(check_cache_dir(cache_dir) / "text", "context")
             if cache_dir is not None else None)
    if store is not None:
        store.sweep()
    keys = {c: _sha("text", c, encoder_id) for c in todo}

    got: dict[str, torch.Tensor] = {}
    reencoded: list[str] = []
    bad: dict[str, str] = {}
    if store is not None:
        for c in todo:
            t = store.load(keys[c], ndim=2)
            if t is not None:
                got[c] = t
    hits = len(got)
    queue = deque(c for c in todo if c not in got)
    shape: tuple[int, ...] | None = None
    misses = 0
    while True:
        if not queue:  # as for latents: a cached entry of a shape not ours is re-encoded
            if shape is None and got:
                shape = Counter(tuple(t.shape) for t in got.values()).most_common(1)[0][0]
            queue = deque(c for c in todo if c in got and tuple(got[c].shape) != shape)
            if not queue:
                break
            for c in queue:
                del got[c]
            hits -= len(queue)
        if stop is not None and stop():
            raise CachingStopped("text", misses, len(queue))
        batch = [queue.popleft()]  # alone: see above
        with torch.no_grad():
            e = encode_text(list(batch))
        if not isinstance(e, torch.Tensor) or e.ndim != 3 or e.shape[0] != len(batch):
            got_s = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
            raise ValueError(f"encode_text must return a (B, L, D) tensor with B={len(batch)},"
                             f" got {got_s}")
        e = e.detach().to("cpu", torch.float32)
        if shape is None:
            shape = tuple(e.shape[1:])
        elif tuple(e.shape[1:]) != shape:
            raise ValueError(f"encode_text returned {tuple(e.shape[1:])} for {batch[0]!r:.60} "
                             f"but {shape} for earlier captions: pad every caption to one "
                             f"length")
        misses += len(batch)
        for j, c in enumerate(batch):
            if not bool(torch.isfinite(e[j]).all()):
                first = _nonfinite(e[j])
                z = None
                if fallback is not None:
                    with torch.no_grad():
                        z = fallback([c]).detach().to("cpu", torch.float32)[0]
                if z is not None and tuple(z.shape) == shape and bool(torch.isfinite(z).all()):
                    reencoded.append(c)
                    log.warning("text cache: the embedding of caption %r was non-finite (%s); "
                                "finite when encoded again in fp32", c[:80], first)
                    e[j] = z
                else:
                    why = (f"its embedding is non-finite ({first})"
                           + (" and again in fp32" if fallback is not None else "")
                           + (f"; {blame(c)}" if blame is not None else ""))
                    if c == "":
                        raise DataError(f"the text encoder's embedding of the empty caption "
                                        f"(the null condition) is {why}: the text encoder "
                                        f"({encoder_id[:12]}) is broken; download it again")
                    bad[c] = why
                    got[c] = torch.zeros(shape)
                    continue  # never cached
            got[c] = e[j].clone()
            if store is not None:
                store.save(keys[c], got[c], {"encoder_id": encoder_id, "caption": c})

    contexts = (torch.stack([got[c] for c in unique]) if unique
                else torch.empty((0, *got[""].shape)))
    return TextResult(contexts=contexts, captions=unique, caption_index=index, null=got[""],
                      hits=hits, misses=misses, seconds=time.perf_counter() - t0,
                      reencoded=reencoded, bad=bad)


# --------------------------------------------------------------------------- conditioning


@dataclass
class ConditioningResult:
    """What :func:`encode_conditioning` returns: where each item's conditioning image
    (ControlNet training, data/pairs.py) is read from when the item is drawn.

    An image folder's conditioning images are prepared once (cropped and resized like their
    images) and kept as uint8 ``(C, H, W)`` safetensors under ``conditioning/`` of the cache
    (keyed by the file's sha256, the preparation and the crop): they are pixels, not
    latents, and uint8 holds them exactly in a quarter of float32's space. An item reads its
    file when drawn (a miss, e.g. a deleted entry, decodes the source file again: the same
    bytes); nothing is held in memory. Without a cache directory (``data.cache_latents:
    false``) every draw decodes the source file. A user dataset's ``conditioning(i)`` is
    called when the item is drawn.

    Attributes:
        source: the paired dataset.
        keys: per source item, its cache key (None: no cache, or a user dataset).
        root: the cache's conditioning folder, or None.
        quarantined: ``{i: {"index", "source", "why"}}``: conditioning images that cannot
            be decoded (left out of training with their images).
        hits, misses, seconds: as for latents.
    """

    source: Any
    keys: list[str] | None = None
    root: Path | None = None
    quarantined: dict[int, dict[str, Any]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0

    def get(self, i: int) -> torch.Tensor:
        """Source item ``i``'s conditioning image, float32 (C, H, W) in [0, 1] (a user
        dataset's as it gives it)."""
        pixels = getattr(self.source, "conditioning_pixels", None)
        if not callable(pixels):
            return conditioning_of(self.source, i)
        t = None
        if self.keys is not None and self.root is not None:
            t = _Store(self.root, "conditioning").load(self.keys[i], 3, torch.uint8)
        if t is None:
            t = pixels(i)
        return t.to(torch.float32).div_(255.0)


def encode_conditioning(dataset: Dataset, *, prep: str, cache_dir: Path | str | None,
                        progress: bool = False,
                        stop: Callable[[], bool] | None = None) -> ConditioningResult:
    """Prepare and cache every conditioning image of a paired image folder (see
    :class:`ConditioningResult`); for a user dataset, nothing (it is read when drawn).

    Args:
        dataset: with ``conditioning_pixels(i)`` (uint8, data/pairs.py) and
            ``conditioning_path_of(i)``, or a user dataset with ``conditioning(i)``.
        prep: the preparation (size, crop, channels): another is another entry.
        cache_dir: the cache root (None: decode on every draw).
        stop: asked before each image; True ends the call with :class:`CachingStopped`.

    Returns:
        The result; a file that cannot be decoded is quarantined (its image with it).
    """
    t0 = time.perf_counter()
    res = ConditioningResult(source=dataset)
    pixels = getattr(dataset, "conditioning_pixels", None)
    if not callable(pixels) or cache_dir is None:
        return res
    n = len(dataset)
    store = _Store(check_cache_dir(cache_dir) / "conditioning", "conditioning")
    store.sweep()
    paths = [str(dataset.conditioning_path_of(i)) for i in range(n)]
    _check_names(paths)
    layout = bucket_layout(dataset)
    item_prep = ([f"{prep},bucket={c.target_size[1]}x{c.target_size[0]},"
                  f"crop={c.crop_top_left[0]},{c.crop_top_left[1]}" for c in layout.crops]
                 if layout is not None else [prep] * n)
    res.keys = [_sha("conditioning", file_digest(p), item_prep[i]) for i, p in enumerate(paths)]
    res.root = store.root
    show = _Progress(progress, "conditioning images", n)
    for i in range(n):
        if store.load(res.keys[i], 3, torch.uint8) is not None:
            res.hits += 1
            continue
        if stop is not None and stop():
            raise CachingStopped("conditioning images", res.misses, n - i)
        try:
            t = pixels(i)
        except DataError as e:
            res.quarantined[i] = {"index": i, "source": pair_name(dataset, i),
                                  "conditioning": paths[i], "why": str(e)}
            log.warning("conditioning: quarantined dataset item %d: %s", i, e)
            continue
        store.save(res.keys[i], t, {"prep": item_prep[i], "source": paths[i]})
        res.misses += 1
        show(i + 1, res.hits)
    res.seconds = time.perf_counter() - t0
    show(n, res.hits, end=True)
    return res


def append_rows(ctx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``ctx`` (L, D) with ``values`` (any shape, flattened) appended as ``ceil(n / D)`` more
    rows of width D, the last one zero-padded: how a ControlNet's conditioning image rides
    at the end of the condition y (integrations/controlnet.py takes it back off the end)."""
    flat = values.reshape(-1).to(ctx.dtype)
    d = ctx.shape[1]
    rows = -(-flat.numel() // d)
    out = ctx.new_zeros(rows * d)
    out[:flat.numel()] = flat
    return torch.cat([ctx, out.view(rows, d)])


# --------------------------------------------------------------------------- the dataset


class EncodedDataset(Dataset):
    """What a latent-space or text-conditioned model trains on.

    Items are ``(x, context)``: ``x`` the latent ``(c, h, w)`` float32 (or, without a
    :class:`LatentResult`, the source image: pixel-space models) and ``context`` its
    caption's embedding ``(L, D)`` float32 (or ``tensor(0)`` without a :class:`TextResult`:
    unconditional). Only the items not quarantined are present; item ``i`` is source item
    ``source_index(i)``, and ``path_of(i)`` names its file, so the guard and the report name
    the file of a bad sample (``steadydiff.data.source_of`` finds it through ``path_of``).

    With latents the dataset holds tensors and strings only (no reference to the source),
    so DataLoader workers unpickle a few arrays, not a dataset of decoders.

    Args:
        source: the dataset the results were computed from (same length, same order).
        latents: from :func:`encode_latents`, or None for pixel space.
        texts: from :func:`encode_texts` over the same items, or None for unconditional.
        variants: a :class:`~steadydiff.data.captions.CaptionVariants` (tag shuffle, caption
            dropout) applied by :meth:`item_at`, the data stream's ``(item, epoch)`` access;
            None (or one that varies nothing): every epoch the same caption.
        tokenize: ``list[str] -> (B, L)`` token ids, needed with shuffle (``texts`` then
            holds token ids and the model encodes them in the step).
        extra: ``(N, k)`` per-item values that ride with the caption's context (SDXL's
            size/crop ids, each item's own): appended as one more row (its first k
            columns, the rest zeros) to an ``(L, D)`` context, or as k more ids to token
            ids ``(L,)``; caption dropout and shuffle change the caption, never them.
        conditioning: a ControlNet's conditioning images (:func:`encode_conditioning`),
            appended after ``extra`` as rows of the context's width (:func:`append_rows`);
            its quarantined items are left out with their images.

    Attributes:
        num_classes: 0 (the condition is the context, not a class).
        channels, image_size: the latent's (or image's) channels and side.
        context_shape: ``(L, D)``, or None without text.
        null_context: the ``(L, D)`` embedding of "", or None without text.
        quarantined: the latent result's quarantine (``{source index: record}``).

    Raises:
        DataError: the results do not match ``source`` (another length), or no item is left.
    """

    trains_as_is = True  # as_pairs/SeededView pass it through: items are (x, context)

    num_classes: int = 0

    def __init__(self, source: Dataset, latents: LatentResult | None = None,
                 texts: TextResult | None = None, *, variants: Any = None,
                 tokenize: Callable[[list[str]], torch.Tensor] | None = None,
                 extra: torch.Tensor | None = None,
                 conditioning: ConditioningResult | None = None) -> None:
        n = len(source)
        if extra is not None and (texts is None or extra.ndim != 2 or len(extra) != n):
            raise DataError(f"extra per-item values must be (N={n}, k) beside the texts, got "
                            f"{tuple(extra.shape)}")
        if latents is not None and latents.total != n:
            raise DataError(f"the latents were encoded from {latents.total} items but the "
                            f"dataset has {n}: encode this dataset")
        if texts is not None and len(texts.caption_index) != n:
            raise DataError(f"{len(texts.caption_index)} captions were encoded but the "
                            f"dataset has {n} items: one caption per item")
        self.source_name = type(source).__name__
        if conditioning is not None and (texts is None or tokenize is not None
                                         and variants is not None and variants.shuffle):
            raise ValueError("conditioning images ride with a text context (L, D)")
        if conditioning is not None and conditioning.quarantined and latents is not None:
            latents = latents.without(conditioning.quarantined)
        self._index = torch.as_tensor(latents.index if latents is not None else range(n),
                                      dtype=torch.int64)  # (N_kept,) source indices
        if len(self._index) == 0:
            q = len(latents.quarantined) if latents is not None else 0
            raise DataError(f"no items to train on: {self.source_name} has {n} items"
                            + (f", all {q} quarantined (non-finite latents)" if q else ""))
        # a pair is named by both files (the guard's drop and quarantine records)
        self._paths = [(pair_name(source, int(i)) if conditioning is not None else None)
                       or source_of(source, int(i)) for i in self._index]
        # Bucketed data: each kept item's bucket and crop (the batch sampler and SDXL's
        # add_time_ids read them; steadydiff.data.buckets.time_ids)
        layout = bucket_layout(source)
        self.bucket_layout: BucketLayout | None = \
            layout.subset(self._index.tolist()) if layout is not None else None
        self._latents = latents.latents if latents is not None else None
        self._source = source if latents is None else None  # pixel space reads the images
        self.quarantined = dict(latents.quarantined) if latents is not None else {}
        if texts is not None:
            self._contexts: torch.Tensor | None = texts.contexts  # (U, L, D)
            self._rows = texts.caption_index[self._index]  # (N_kept,) row of each item
            self.null_context: torch.Tensor | None = texts.null
            self.context_shape: tuple[int, int] | None = tuple(texts.null.shape)
            self._distinct = len(texts.captions)
        else:
            self._contexts = self._rows = self.null_context = self.context_shape = None
            self._distinct = 0
        # Captions that change per epoch (data.caption_shuffle / caption_dropout): a
        # CaptionVariants; with shuffle the item is the token ids of its caption of the epoch
        # (``tokenize``), encoded by the model in the step; dropout alone needs only the
        # cached null embedding.
        self.variants = variants if variants is not None and variants.varies else None
        self._tokenize = tokenize
        self._captions: list[str] | None = None
        if self.variants is not None and self.variants.shuffle:
            if tokenize is None or texts is None:
                raise ValueError("shuffled captions need texts and a tokenize callable")
            self._captions = [texts.captions[int(r)] for r in self._rows]
        self._extra = extra[self._index] if extra is not None else None  # (N_kept, k)
        self.conditioning = conditioning
        x0 = self._latents[0] if self._latents is not None else self[0][0]
        self.channels, self.image_size = int(x0.shape[0]), int(x0.shape[-1])
        if self.bucket_layout is not None and self._latents is not None:
            self.image_size = source.image_size // (int(self.bucket_layout.crops[0]
                                                        .target_size[1]) // self.image_size)
        self.item_shape = tuple(x0.shape)

    def __len__(self) -> int:
        return len(self._index)

    def _item(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._latents is not None:
            x = self._latents[i].clone()  # a copy: an in-place edit must not reach the cache
        else:
            x = self._source[int(self._index[i])][0]
        if self._contexts is None:
            return x, torch.tensor(0)
        return x, self._contexts[self._rows[i]].clone()

    def _with_extra(self, i: int, ctx: torch.Tensor) -> torch.Tensor:
        """``ctx`` with item ``i``'s extra values (see ``extra``) and conditioning image
        (see ``conditioning``) appended."""
        if self.conditioning is not None:
            ctx = append_rows(self._add_extra(i, ctx),
                              self.conditioning.get(int(self._index[i])))
            return ctx
        return self._add_extra(i, ctx)

    def _add_extra(self, i: int, ctx: torch.Tensor) -> torch.Tensor:
        if self._extra is None:
            return ctx
        e = self._extra[i]
        if ctx.ndim == 1:  # token ids
            return torch.cat([ctx, e.to(ctx.dtype)])
        row = ctx.new_zeros(1, ctx.shape[1])
        row[0, :len(e)] = e
        return torch.cat([ctx, row])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, ctx = self._item(i)
        return x, self._with_extra(i, ctx)

    def item_at(self, i: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Item ``i`` as the data stream's ``(i, epoch)`` key sees it: its caption shuffled
        and/or dropped for that epoch (a pure function of the run seed, ``epoch`` and ``i``);
        without varying captions, ``self[i]``."""
        if self.variants is None or self._contexts is None:
            return self[i]
        x, ctx = self._item(i)
        if self._captions is not None:  # shuffle: the epoch's caption as token ids (L,)
            ctx = self._tokenize([self.variants(self._captions[i], i, epoch,
                                                int(self._index[i]))])[0]
        elif self.variants.dropped(i, epoch):  # the empty caption's cached embedding
            ctx = self.null_context.clone()
        return x, self._with_extra(i, ctx)

    def source_index(self, i: int) -> int:
        """The index in the source dataset of item ``i``."""
        return int(self._index[i])

    def path_of(self, i: int) -> str | None:
        """Item ``i``'s file (through ``source_of`` of the source), or None."""
        return self._paths[i]

    def describe(self) -> str:
        """One line for the run log, e.g. ``EncodedDataset: 98 latents 4×16×16 of
        ImageFolderDataset (2 quarantined), 12 distinct captions 77×768``."""
        what = "latents" if self._latents is not None else "images"
        s = f"EncodedDataset: {len(self)} {what} {'×'.join(map(str, self.item_shape))} of " \
            f"{self.source_name}"
        if self.quarantined:
            s += f" ({len(self.quarantined)} quarantined)"
        if self.context_shape is not None:
            s += f", {self._distinct} distinct captions {'×'.join(map(str, self.context_shape))}"
        else:
            s += ", unconditional"
        return s
