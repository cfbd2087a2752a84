"""Every file steadydiff hands back to a user is new or explicitly replaced, and whole.

One owner for writing outputs (``export``, ``sample``, ``ema``, ``merge``, the report, a
run's marker) and for saying why a write failed:

* :func:`check_output` refuses an existing target unless the user asked to replace it
  (``--force``), a target that is a directory, and a target that is one of the command's own
  inputs (or inside one): an export onto the diffusers folder it reads from destroyed it.
* :func:`atomic_output` writes through a hidden temporary in the target's own folder
  (``.NAME.tmp-PID``), fsyncs it, gives it the mode a plain ``open()`` would (umask, not
  the 0600 of a temporary file) and renames it over the target, then fsyncs the folder. A
  full disk or a kill leaves the old file (or nothing) and no temporary: a failure removes
  it, a SIGTERM is turned into an exception while a write is in progress so the cleanup runs,
  and temporaries of dead writers (SIGKILL) are swept the next time that target is written.
* :func:`write_failure` recognises a storage failure however the library reports it:
  ``OSError`` (ENOSPC, EDQUOT, EFBIG, EACCES, EROFS, EIO), safetensors' ``SafetensorError``
  wrapping an ``IoError``, torch's ``[enforce fail ...] file write failed`` ``RuntimeError``;
  :func:`describe_failure` says it in one sentence naming the path and the free space.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator

__all__ = ["OutputExists", "WriteFailed", "check_output", "atomic_output", "atomic_dir",
           "write_text_atomic", "write_failure", "describe_failure", "failure_reason",
           "free_space",
           "follow_umask", "fsync_dir", "sweep_temporaries"]


class OutputExists(ValueError):
    """The output path exists (or is an input, or a directory) and was not to be replaced:
    nothing was written (exit code 2)."""


class WriteFailed(OSError):
    """An output could not be written (disk full, quota, file size limit, permission): the
    message names the path and the free space; the old file, if any, is intact."""

    def __str__(self) -> str:
        return str(self.strerror)


# errors a write can meet that are the storage's, not the program's
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                   errno.EROFS, errno.EIO}
_UNSAID = -1  # a storage failure whose library does not say which (torch's zip writer)
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


# --------------------------------------------------------------------------- refusing


def _is_within(p: Path, other: Path) -> bool:
    try:
        p.resolve().relative_to(other.resolve())
        return True
    except ValueError:
        return False


def check_output(out: str | Path, *, force: bool = False, inputs: Iterable[str | Path] = (),
                 what: str = "--out", directory: bool = False) -> Path:
    """Refuse an output that would destroy something: an existing target without ``force``,
    a directory where a file goes (or a file where a folder goes), a target that is one of
    ``inputs`` or lies inside one, or an input that lies inside the target.

    Returns the output path. Raises :class:`OutputExists` naming it and the way out.
    """
    out = Path(out)
    for src in inputs:
        src = Path(src)
        if src.exists() and (_is_within(out, src) or (out.exists() and _is_within(src, out))):
            how = "is" if out.resolve() == src.resolve() else (
                "is inside" if _is_within(out, src) else "holds")
            raise OutputExists(f"{what} {out} {how} this command's own input {src}; writing "
                               "there would destroy what is being read. Nothing was written; "
                               "choose another path")
    if out.exists() or out.is_symlink():
        if out.is_dir() and not directory:
            raise OutputExists(f"{what} {out} is a directory; name the file to write "
                               f"(e.g. {out / 'model.safetensors'})")
        if directory and not out.is_dir():
            raise OutputExists(f"{what} {out} is a file; name a new directory")
        if directory and out.is_dir() and not any(out.iterdir()):
            return out  # an empty folder: nothing to lose
        if not force:
            raise OutputExists(f"{what} {out} already exists; nothing was written. Pass "
                               "--force to replace it, or choose a new path")
    return out


# --------------------------------------------------------------------------- writing


def _umask() -> int:
    """The process umask. Linux reports it in /proc; elsewhere reading it means setting it
    (process-wide, for an instant)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open()`` (``mkdir``) would: libraries that write
    through a temporary file create it 0600 whatever the umask."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    if path.is_dir():
        for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
            fsync_dir(d)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temporaries(final: Path) -> None:
    """Remove the temporaries a killed writer of ``final`` left (``.NAME.tmp-PID`` whose
    process is gone): only those, never anything else in the folder."""
    parent = final.parent
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        m = _TMP.match(p.name)
        if m and m["name"] == final.name and int(m["pid"]) != os.getpid() \
                and not _pid_alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() \
                else p.unlink(missing_ok=True)


class _Terminated(BaseException):
    """SIGTERM while an output was being written: unwinds so the temporary is removed."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While writing, SIGTERM (what ``kill`` and job schedulers send) raises instead of
    ending the process on the spot, so ``finally`` blocks remove the temporary; the process
    then ends as SIGTERM would have (exit 143). Only where Python's default is in place
    and on the main thread (a trainer's own handler is left alone)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise _Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def atomic_output(final: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``final`` to write (a file, or with ``directory`` a
    folder, created empty); on success it is fsynced, given the umask's mode and renamed
    over ``final`` (a folder already there is swapped out and removed after). On any
    failure, or SIGTERM, the temporary is removed and the old ``final`` is untouched. A
    storage failure is raised as :class:`WriteFailed` (see :func:`describe_failure`)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    with _sigterm_unwinds():
        try:
            if directory:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            yield tmp
            if directory:
                follow_umask(tmp, directory=True)
                for p in tmp.rglob("*"):
                    follow_umask(p, directory=p.is_dir())
            else:
                follow_umask(tmp)
            _fsync_tree(tmp)
            if directory and final.is_dir() and not final.is_symlink():
                old = final.parent / f".{final.name}.tmp-{os.getpid()}-old"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(final.parent)
        except BaseException as e:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            if isinstance(e, Exception) and not isinstance(e, WriteFailed) \
                    and write_failure(e) is not None:
                raise WriteFailed(write_failure(e), describe_failure(final, e)) from None
            raise


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """:func:`atomic_output` for a folder (a diffusers model folder, a run for ``merge``)."""
    with atomic_output(final, directory=True) as tmp:
        yield tmp


def write_text_atomic(path: str | Path, text: str, *, replace: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically (refused if it exists, unless ``replace``)."""
    path = Path(path)
    if not replace:
        check_output(path, what="output")
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- failures


def write_failure(e: BaseException) -> int | None:
    """The errno of ``e`` if it is a storage failure (however the writing library wraps
    it), else None: ``OSError``; safetensors' ``SafetensorError`` ("IoError(Os { code: 28,
    ... })"); torch's ``RuntimeError`` from its zip writer ("[enforce fail at
    inline_container.cc] ... file write failed", "unexpected pos")."""
    if isinstance(e, WriteFailed):
        return e.errno
    if isinstance(e, OSError):
        return e.errno if e.errno in _STORAGE_ERRNOS else None
    text = str(e)
    if type(e).__name__ == "SafetensorError" and ("IoError" in text or "I/O error" in text):
        m = re.search(r"(?:code:\s*|os error\s*)(\d+)", text)
        return int(m.group(1)) if m else errno.EIO
    if isinstance(e, RuntimeError) and "enforce fail" in text and (
            "write" in text or "unexpected pos" in text):
        m = re.search(r"errno\s*(\d+)", text)
        return int(m.group(1)) if m else _UNSAID
    return None


def free_space(path: str | Path) -> int | None:
    """Bytes free for this user on the file system holding ``path`` (its nearest existing
    parent), or None when it cannot be read."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def failure_reason(path: str | Path, e: BaseException) -> str:
    """Why a write under ``path`` failed and the free space there ("the disk is full;
    3.0 MiB free there")."""
    code = write_failure(e) or getattr(e, "errno", None)
    why = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
           errno.EFBIG: "the file is larger than this process may write (a file size "
                        "limit: ulimit -f)",
           errno.EACCES: "permission denied", errno.EPERM: "permission denied",
           errno.EROFS: "the file system is read-only",
           errno.EIO: "an I/O error",
           _UNSAID: "the write failed (the disk is full, a quota or a file size limit was "
                    "reached)"}.get(code, str(e).strip().splitlines()[0] if str(e)
                                          else type(e).__name__)
    free = free_space(path)
    return why + (f"; {_size(free)} free there" if free is not None else "")


def describe_failure(path: str | Path, e: BaseException) -> str:
    """One sentence for a failed write: what, where, why, and the free space there."""
    return (f"could not write {path}: {failure_reason(path, e)}. Nothing was replaced; free "
            "some space (or choose another path) and run the command again")

