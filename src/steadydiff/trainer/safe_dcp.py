"""Reading a sharded (DCP) checkpoint without running anything it carries.

PyTorch's ``FileSystemReader`` unpickles ``.metadata`` with plain :mod:`pickle`, and DCP's
load planners read every non-tensor item (the optimizer's ``param_groups``) with
``torch.load(weights_only=False)``: a doctored checkpoint folder runs its payload the moment
it is opened. A manifest's hashes prove the files are the ones it lists, not who wrote them
(anyone can re-hash), so a checkpoint someone hands over is untrusted input.

Here the metadata goes through an allow-list unpickler that can build only DCP's own
metadata records (dataclasses of names, sizes and offsets), torch dtypes/layouts/sizes and
paths; anything else (``os.system``, ``builtins.eval``, any other class) is refused before it
is built. Non-tensor items load with ``torch.load(weights_only=True)`` (numbers, strings,
tuples, dicts, tensors). A storage entry naming a file outside the checkpoint folder is
refused too. Every refusal is an :class:`UnsafeCheckpoint` naming the file and what it asked
for; the checkpoint loader turns it into a :class:`~steadydiff.trainer.checkpoint.CheckpointError`.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                          _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["UnsafeCheckpoint", "SafeReader", "SafeLoadPlanner", "SafeEmptyLoadPlanner",
           "ALLOWED_GLOBALS", "read_metadata_file", "load", "why_refused"]

# What DCP's own .metadata pickles reference (torch 2.4 - 2.13): its metadata dataclasses,
# the storage record of the file system writer, torch's Size, and pathlib paths (the
# checkpoint id). dtypes and layouts are matched by kind below, not by name.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name, nothing else
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class UnsafeCheckpoint(ValueError):
    """A DCP file asked for something a checkpoint written by DCP never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"it references {module}.{name}, which DCP metadata never "
                               f"holds (refused before anything was built)")


def read_metadata_file(f: io.BufferedIOBase) -> Metadata:
    """DCP's ``.metadata`` through the allow-list unpickler, checked to be a ``Metadata``."""
    try:
        md = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # truncated or garbage: a plain refusal, not a traceback
        raise UnsafeCheckpoint(f"it is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpoint(f"it holds a {type(md).__name__}, not DCP metadata")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        p = PurePosixPath(str(rel))
        if not isinstance(rel, str) or len(p.parts) != 1 or p.name in ("", ".", "..") \
                or "\\" in rel:
            raise UnsafeCheckpoint(f"a storage entry names {rel!r}, not a file of the "
                                   f"checkpoint folder")
    return md


class SafeReader(FileSystemReader):
    """DCP's file system reader with the metadata read by :func:`read_metadata_file`;
    only the safe planners below may read non-tensor items through it."""

    refused: UnsafeCheckpoint | None = None  # the first refusal (DCP wraps what it raises)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                md = read_metadata_file(f)
            except UnsafeCheckpoint as e:
                self.refused = self.refused or UnsafeCheckpoint(f"{path}: {e}")
                raise self.refused from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        if not isinstance(planner, _SafeBytes):
            raise UnsafeCheckpoint("a DCP checkpoint is read with steadydiff's safe load "
                                   "planners only (non-tensor items load weights_only=True)")
        try:
            return super().read_data(plan, planner)
        except UnsafeCheckpoint as e:
            self.refused = self.refused or UnsafeCheckpoint(f"{self.path}: {e}")
            raise


def load(state_dict: dict[str, Any], folder: str | os.PathLike, *, consolidate: bool,
         no_dist: bool) -> None:
    """``dcp.load`` of ``folder`` into ``state_dict`` through :class:`SafeReader` and a safe
    planner (``consolidate``: every item whole, into the empty ``state_dict``; otherwise into
    the live state dict's own, possibly sharded, tensors). The metadata is checked before DCP
    plans anything; a refusal is raised as the :class:`UnsafeCheckpoint` itself, not DCP's
    wrapped per-rank exception."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    md = Path(folder) / ".metadata"
    with open(md, "rb") as f:
        try:
            read_metadata_file(f)
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"{md}: {e}") from None
    reader = SafeReader(str(folder))
    try:
        if consolidate:
            _load_state_dict(state_dict, storage_reader=reader,
                             planner=SafeEmptyLoadPlanner(), no_dist=True)
        else:
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(),
                     no_dist=no_dist)
    except BaseException:  # DCP's CheckpointException is a BaseException
        if reader.refused is not None:
            raise reader.refused from None
        raise


def why_refused(e: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in one clause ("Unsupported global:
    GLOBAL io.open"), without torch's advice: re-running with ``weights_only=False`` or
    ``add_safe_globals([...])`` is exactly what must never be done with a file someone
    handed over. Every caller that reports a refused pickle words it through here."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    why = next((ln for ln in lines if "Unsupported global" in ln or "Unsupported operand" in ln),
               lines[0] if lines else type(e).__name__)
    why = why.split("WeightsUnpickler error: ")[-1]
    for cut in (" was not an allowed global", ". Please use", " Re-running"):
        why = why.split(cut)[0]
    if "weights_only" in why or "add_safe_globals" in why:  # only advice left: say what it is
        why = "it needs Python objects beyond tensors and plain data to load"
    return why


def _load_item(read_item: ReadItem, value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True, map_location="cpu")
    except Exception as e:
        raise UnsafeCheckpoint(f"item {read_item.dest_index.fqn!r} cannot be loaded safely "
                               f"({why_refused(e)}); it was not unpickled") from None


class _SafeBytes:
    """``load_bytes`` as DCP's default planner does it, with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = _load_item(read_item, value)
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict,  # type: ignore[attr-defined]
                self.mappings[read_item.dest_index.fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[read_item.dest_index.fqn] = obj  # type: ignore[attr-defined]


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner (into a live state dict), non-tensor items weights-only."""


class SafeEmptyLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """DCP's consolidating planner (every item, whole), non-tensor items weights-only."""
