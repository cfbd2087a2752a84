"""A quiet console: the third-party log lines that carry nothing for the user are kept out
of it, and kept, whole, in the run's ``third_party.log``.

The libraries a Stable Diffusion run imports (torch, torchao, transformers, diffusers) log
notices at import and load time (torchvision missing, torchao kernels not built, the
safety checker disabled, "No LoRA keys associated to CLIPTextModel" when a LoRA has no
text-encoder part) and draw progress bars for every part they load. On a terminal they
drown the run's own lines. :data:`NOISE` lists the lines dropped, each with why it carries
nothing; anything not listed (a real warning from any library) still reaches the console.

transformers and diffusers (and torch) log through their own handlers on their library
loggers with ``propagate = False``, installed when they are first imported (seconds to tens
of seconds: not done here ahead of time). :func:`install` therefore creates those library
loggers first, of a logger class whose ``addHandler`` puts the filter on every handler a
library adds; a library already imported gets it on the handlers it has. Records a filter
drops are buffered (the run directory does not exist yet at import) and written to the run
directory's ``third_party.log`` once :func:`log_to` names it. Progress bars are turned off
through huggingface_hub's ``HF_HUB_DISABLE_PROGRESS_BARS`` (transformers reads it) and
diffusers' own switch where it is imported.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path

__all__ = ["NOISE", "LOG_FILE", "install", "log_to", "is_noise"]

LOG_FILE = "third_party.log"  # in the run directory

# (logger name prefix, or "" for any; message regex; why it is noise for a steadydiff user)
NOISE: tuple[tuple[str, str, str], ...] = (
    ("transformers", r"requires torchvision \(not installed\)",
     "image processors of models steadydiff does not use"),
    ("diffusers", r"Unable to import `torchao` Tensor objects",
     "torchao quantized checkpoints, which steadydiff does not load"),
    ("torchao", r"", "torchao's optional CUDA/triton kernels; steadydiff does not use them"),
    ("torch", r"is an Enum subclass and is now natively supported by torch\.compile",
     "a deprecation inside torchao's import"),
    ("diffusers", r"No LoRA keys associated to \w+",
     "a LoRA without a text-encoder part loaded into a pipeline: expected"),
    ("diffusers", r"You have disabled the safety checker",
     "steadydiff's own samples never run the safety checker"),
    ("diffusers", r"You did not specify `torch_dtype`.*float32",
     "steadydiff sets every part's dtype itself"),
    ("diffusers", r"Keyword arguments \{.*\} are not expected by .* and will be ignored",
     "the folder's own config keys a newer diffusers dropped"),
)
_COMPILED = [(who, re.compile(pat)) for who, pat, _ in NOISE]
_LIBRARIES = ("transformers", "diffusers", "torch", "torchao", "huggingface_hub", "peft")
_BUFFER_MAX = 2000  # records kept before the run directory is known


def is_noise(record: logging.LogRecord) -> bool:
    """Whether ``record`` is one of :data:`NOISE` (by its logger and message)."""
    name = record.name
    try:
        msg = record.getMessage()
    except (TypeError, ValueError):  # a malformed record is not ours to hide
        return False
    for who, pat in _COMPILED:
        if who and not (name == who or name.startswith(who + ".")):
            continue
        if pat.search(msg):
            return True
    return False


class _Sink:
    """Where dropped records go: a buffer until :func:`log_to`, then the run's file."""

    def __init__(self) -> None:
        self.buffer: list[logging.LogRecord] = []
        self.handler: logging.Handler | None = None

    def keep(self, record: logging.LogRecord) -> None:
        if self.handler is not None:
            self.handler.handle(record)
        elif len(self.buffer) < _BUFFER_MAX:
            self.buffer.append(record)


_SINK = _Sink()


class NoiseFilter(logging.Filter):
    """Drops :data:`NOISE` records from the handler it is on (kept in ``third_party.log``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if is_noise(record):
            if not getattr(record, "_steadydiff_kept", False):  # once, whatever the handlers
                record._steadydiff_kept = True
                _SINK.keep(record)
            return False
        return True


_FILTER = NoiseFilter()


def _quiet(handler: logging.Handler) -> None:
    if _FILTER not in handler.filters:
        handler.addFilter(_FILTER)


class _LibraryLogger(logging.Logger):
    """A library's root logger: every handler the library adds gets the noise filter."""

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 (logging's name)
        _quiet(hdlr)
        super().addHandler(hdlr)


def install() -> None:
    """Filter :data:`NOISE` out of the console (idempotent): the root logger's handlers,
    each library logger's (created now as :class:`_LibraryLogger` where not yet imported),
    Python warnings (through logging), and the libraries' progress bars."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # hub's and transformers'
    logging.captureWarnings(True)  # warnings.warn -> the 'py.warnings' logger -> filtered
    warnings.filterwarnings("default")  # each distinct warning once per location
    for h in logging.getLogger().handlers:
        _quiet(h)
    manager = logging.Logger.manager
    for name in _LIBRARIES:
        existing = manager.loggerDict.get(name)
        if isinstance(existing, logging.Logger):  # imported already: its handlers now
            for h in existing.handlers:
                _quiet(h)
            continue
        old = logging.getLoggerClass()
        logging.setLoggerClass(_LibraryLogger)
        try:
            logging.getLogger(name)
        finally:
            logging.setLoggerClass(old)
    if "diffusers" in sys.modules:
        try:
            from diffusers.utils import logging as dlog
            dlog.disable_progress_bar()
        except ImportError:
            pass


def log_to(run_dir: str | Path) -> Path:
    """Write the dropped records (those buffered so far, and every later one) to
    ``run_dir/third_party.log``, appended; returns its path."""
    path = Path(run_dir) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if _SINK.handler is not None and getattr(_SINK.handler, "baseFilename", "") == \
            str(path.resolve()):
        return path
    if _SINK.handler is not None:
        _SINK.handler.close()
    h = logging.FileHandler(path, encoding="utf-8", delay=True)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _SINK.handler = h
    for r in _SINK.buffer:
        h.handle(r)
    _SINK.buffer.clear()
    return path
