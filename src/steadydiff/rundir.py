"""The run directory: the one place that knows its layout.

    RUN/
      config.yaml         the resolved config (written at every start)
      metrics.jsonl       one row per log_every steps (trainer/telemetry.py owns the keys)
      layers.jsonl        per-layer statistics (logging.layer_stats_every)
      incidents.jsonl     one row per guard intervention (created empty at the start)
      eval.jsonl          one row per evaluation during training
      summary.json        how the run ended (finished / aborted)
      buckets.json        data.buckets: the aspect-ratio buckets and their image counts
      report.html         the health report
      samples/step_00001234.png
      samples/step_00001234/prompts.json, prompt_00.png   a text run's validation prompts:
                                               which grid cell holds which, each one's images
      checkpoints/step_00001234/ ... latest    (trainer/checkpoint.py owns the format)
      checkpoints/best/step_00001234/          the best evaluation's checkpoint
      checkpoints/posthoc_best/                the best post-hoc EMA (`steadydiff ema --sweep`):
                                               what `steadydiff sample RUN` samples from
      posthoc/step_00001234.safetensors        post-hoc EMA profile snapshots (train.ema_posthoc;
                                               outside checkpoints/: never rotated away)
      posthoc/sweep.json, sweep.md, sweep.png  `steadydiff ema --sweep`'s table and plot
      checkpoints/corrupt/step_00001234/       checkpoints that failed verification on resume,
                                               moved aside (never deleted; rotation skips them)
      run.lock            pid, host and start time of the process training into the run
      steadydiff-run.json the marker: written by steadydiff when it starts a run here (the
                          run's id, when, which version); only a folder holding it, or the
                          verified checkpoints of a run from before the marker, is a run
      previous-20260101-120000/                an earlier run's files, moved by --restart

Safety (docs/RELIABILITY.md, "Run-directory safety"): training refuses a folder that holds
something else, a run another live process is training into, and a run whose every
checkpoint is corrupt; nothing of an earlier run is deleted or overwritten by a resume or
a restart, it is moved aside.

Writers (the trainer, the guard, evaluation) and readers (report, doctor, the API) name files
through :class:`RunDir`, so the layout is written down once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import __version__
from .trainer import checkpoint as ckpt

# the append-only logs of a run, truncated to the resumed step on resume
JSONL_LOGS = ("metrics.jsonl", "layers.jsonl", "incidents.jsonl", "eval.jsonl")
_GRID = re.compile(r"^step_(\d+)\.png$")
_PREVIOUS = "previous-"
MARKER = "steadydiff-run.json"
_MARKER_KIND = "steadydiff-run"
log = logging.getLogger(__name__)


class RunDirError(RuntimeError):
    """The run directory cannot be trained into as asked: it holds something else, another
    process is training into it, or none of its checkpoints can be used (exit code 2)."""


# files a user's shell or scheduler may create in the run folder before the run starts
LOG_SUFFIXES = (".log", ".out", ".err")


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (nothing is created until a writer needs it)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    # ---- files
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def layers(self) -> Path:
        return self.root / "layers.jsonl"

    @property
    def incidents(self) -> Path:
        return self.root / "incidents.jsonl"

    @property
    def evals(self) -> Path:
        return self.root / "eval.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def buckets(self) -> Path:
        return self.root / "buckets.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    @property
    def lock_file(self) -> Path:
        """Who is training into the run (JSON: pid, host, started); empty when nobody."""
        return self.root / "run.lock"

    # ---- folders
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def best(self) -> Path:
        """The best evaluation's checkpoint root (one checkpoint; rotation never touches it)."""
        return self.checkpoints / "best"

    @property
    def posthoc(self) -> Path:
        """Post-hoc EMA snapshots and sweep results (docs/ema.md); rotation never touches it."""
        return self.root / "posthoc"

    @property
    def posthoc_best(self) -> Path:
        """The post-hoc EMA checkpoint ``steadydiff ema --sweep`` chose (one checkpoint
        directory, not a root); ``steadydiff sample RUN`` and ``steadydiff eval RUN`` prefer it."""
        return self.checkpoints / "posthoc_best"

    @property
    def corrupt(self) -> Path:
        """Where checkpoints that failed verification on resume are moved (kept, not used)."""
        return self.checkpoints / "corrupt"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def sample_grid(self, step: int) -> Path:
        return self.samples / f"{ckpt.checkpoint_name(step)}.png"

    def sample_grids(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every sample grid, oldest first."""
        if not self.samples.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.samples.iterdir()
                      if (m := _GRID.match(p.name)) and p.is_file())

    def validation(self, step: int) -> Path:
        """The folder of one render's validation prompts (trainer/validation.py)."""
        return self.samples / ckpt.checkpoint_name(step)

    def latest_validation(self) -> tuple[int, Path] | None:
        """``(step, folder)`` of the newest render with a prompts.json, or None."""
        for step, _ in reversed(self.sample_grids()):
            if (self.validation(step) / "prompts.json").is_file():
                return step, self.validation(step)
        return None

    # ---- checkpoints
    def list_checkpoints(self) -> list[Path]:
        """Checkpoint directories, newest step first."""
        return ckpt.list_checkpoints(self.checkpoints)

    def checkpoint_candidates(self) -> list[Path]:
        """Checkpoints in the order to try them (the ``latest`` pointer's first)."""
        return ckpt.candidates(self.checkpoints)

    def latest_good(self) -> Path | None:
        """The newest checkpoint that passes verification, or None."""
        return ckpt.latest_good(self.checkpoints)

    @property
    def marker(self) -> Path:
        """``steadydiff-run.json``: the run's identity, written when steadydiff starts it."""
        return self.root / MARKER

    # ---- what kind of folder this is
    def identity(self) -> dict | None:
        """The marker's contents (``{"kind", "id", "created", "steadydiff"}``), or None
        when the folder has no valid marker."""
        try:
            info = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("kind") == _MARKER_KIND else None

    def is_run(self) -> bool:
        """Whether steadydiff wrote this folder: it holds the marker, or (a run from before
        the marker) a checkpoint steadydiff wrote, its manifest and state. Common file
        names are never evidence: a user's project folder may hold a ``config.yaml``,
        ``checkpoints/`` or ``metrics.jsonl`` of its own, and nothing of it may be
        overwritten, rotated or swept."""
        if not self.root.is_dir():
            return False
        return self.identity() is not None or self._run_before_marker()

    def _run_before_marker(self) -> bool:
        for c in self.list_checkpoints():
            try:
                mf = json.loads((c / "manifest.json").read_text())
                state = json.loads((c / "state.json").read_text())
            except (OSError, ValueError):
                continue
            if (isinstance(mf, dict) and isinstance(state, dict) and "format" in mf
                    and isinstance(mf.get("files"), dict) and "state.json" in mf["files"]
                    and isinstance(state.get("config"), dict)):
                return True
        return False

    def has_run_files(self) -> bool:
        """Whether the folder holds files a run has (checkpoints/, metrics.jsonl, ...):
        enough for a reader that writes nothing into it (``doctor``, ``report --out``
        elsewhere), never for a writer (:meth:`is_run`)."""
        return self.root.is_dir() and (self.is_run() or any(
            p.exists() for p in (self.checkpoints, self.metrics, self.incidents, self.summary)))

    def mark(self) -> dict:
        """Write the marker if the folder has none (a new run, or a run from before the
        marker adopted on resume); returns the run's identity."""
        info = self.identity()
        if info is not None:
            return info
        import uuid

        from .files import write_text_atomic

        info = {"kind": _MARKER_KIND, "id": uuid.uuid4().hex,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steadydiff": __version__}
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.marker, json.dumps(info, indent=1) + "\n", replace=True)
        return info

    def check_target(self) -> None:
        """Refuse to train into anything but a run, an empty folder or a new path.

        Raises:
            RunDirError: the path is a file, or a non-empty folder that is not a run (its
                config.yaml, metrics.jsonl and report.html would be overwritten).
        """
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"--out {self.root} is a file, not a directory; choose a "
                              "directory (a new path is created)")
        if not self.root.is_dir() or self.is_run():
            return
        # a log the shell opened before the run started (`... > RUN/train.log`, SLURM's
        # --output) is no file steadydiff writes: it is left alone, not a reason to refuse
        # the lock is taken before the marker is written: a folder holding only a lock is
        # one another steadydiff is starting in (lock() then names that process)
        there = sorted(p.name + ("/" if p.is_dir() else "") for p in self.root.iterdir()
                       if not (p.is_file() and (p.suffix in LOG_SUFFIXES
                                                or p.name == self.lock_file.name)))
        if there:
            raise RunDirError(
                f"{self.root} is not empty and is not a steadydiff run (it holds "
                f"{', '.join(there[:5])}{f' and {len(there) - 5} more' if len(there) > 5 else ''}"
                f"; no {MARKER}, which every run steadydiff starts writes); training would "
                "overwrite its config.yaml, metrics.jsonl and report.html, and rotation would "
                "delete from its checkpoints/. Nothing was changed. Choose a new or empty --out "
                "directory")

    def lock(self) -> tuple["RunLock", str | None]:
        """Lock the run for this process; see :meth:`RunLock.acquire`."""
        return RunLock.acquire(self)

    # ---- resume and restart
    def resume_point(self, say: Callable[[str], None] = print) -> Path | None:
        """The checkpoint to resume from: the newest that verifies (``latest`` first).

        Corrupt checkpoints met on the way are moved to ``checkpoints/corrupt/`` (and said
        so) once a good one is found; with no good one nothing is moved and the run refuses,
        so a rerun never silently starts over on top of the old run.

        Raises:
            RunDirError: every checkpoint failed verification (each is listed with the
                reasons), or a checkpoint is a symlink leading outside the run.
        """
        rejected: list[tuple[Path, list[str]]] = []
        for c in self.checkpoint_candidates():
            self._check_link(c)
            problems = ckpt.verify_checkpoint(c)
            if not problems:
                # a stale ``latest`` (a kill between rename and pointer) can pick an older
                # one: a corrupt newer one would be overwritten when the run reaches its step
                newer = [p for p in self.list_checkpoints() if p != c
                         and (ckpt.step_of(p) or 0) > (ckpt.step_of(c) or 0)
                         and all(p != bad for bad, _ in rejected)]
                rejected += [(p, why) for p in newer if (why := ckpt.verify_checkpoint(p))]
                for bad, why in rejected:
                    say(f"warning: checkpoint {bad.name} failed verification; moved it to "
                        f"{self.set_aside(bad, why)} (kept, not used)")
                return c
            log.warning("skipping corrupt checkpoint %s: %s", c, "; ".join(problems))
            rejected.append((c, problems))
        if rejected:
            listed = "\n".join(f"  {c.name}: {'; '.join(why)}" for c, why in rejected)
            raise RunDirError(
                f"{self.root}: every checkpoint failed verification:\n{listed}\nnothing was "
                "changed. Resume from a checkpoint you trust with --resume PATH, or start "
                "over with --restart (the old run's files are moved to "
                f"{self.root}/{_PREVIOUS}<time>/, not deleted)")
        return None

    def _check_link(self, c: Path) -> None:
        """Like an image folder's symlinks (data.follow_symlinks), a checkpoint linked from
        outside the run is not used unless asked for by name."""
        if not c.is_symlink():
            return
        target = c.resolve()
        # checkpoints/ itself may be a link (to a scratch disk): inside it is inside the run
        if not any(target.is_relative_to(d.resolve()) for d in (self.root, self.checkpoints)):
            raise RunDirError(
                f"checkpoint {c} is a symlink to {target}, outside the run directory; it is "
                f"not used unless asked for: pass --resume {target} (steadydiff.train("
                f"resume=...)) to resume from it, or remove the link")

    def set_aside(self, c: Path, problems: list[str]) -> Path:
        """Move checkpoint ``c`` to ``checkpoints/corrupt/`` with a note of why; returns the
        new path (a name already taken there gets a suffix: nothing is overwritten)."""
        self.corrupt.mkdir(parents=True, exist_ok=True)
        dest = _free(self.corrupt / c.name)
        os.replace(c, dest)
        dest.with_name(dest.name + ".why.txt").write_text("\n".join(problems) + "\n")
        return dest

    def restart(self) -> Path | None:
        """Move everything of the current run (not the lock, not earlier ``previous-*``
        folders) into ``previous-<time>/``, so a fresh run starts in an empty folder and
        nothing is deleted. Returns that folder, or None when there was nothing to move."""
        if not self.root.is_dir():
            return None
        keep = {self.lock_file.name}
        move = [p for p in self.root.iterdir()
                if p.name not in keep and not p.name.startswith(_PREVIOUS)]
        if not move:
            return None
        dest = _free(self.root / f"{_PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}")
        dest.mkdir()
        for p in move:
            os.replace(p, dest / p.name)
        self.mark()  # the fresh run's own identity (the old marker went with its files)
        return dest

    @staticmethod
    def of_checkpoint(path: str | Path) -> "RunDir | None":
        """The run a checkpoint directory belongs to (``RUN/checkpoints/step_*``), if any."""
        p = Path(path)
        if p.parent.name != "checkpoints":
            return None
        run = RunDir(p.parent.parent)
        return run if run.metrics.is_file() or run.config.is_file() else None


def _free(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2`` ... : the first name not taken."""
    n, p = 0, path
    while p.exists() or p.is_symlink():
        n += 1
        p = path.with_name(f"{path.name}-{n}")
    return p


# --------------------------------------------------------------------------- the lock


def _lock_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _describe(info: dict) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started "
            f"{info.get('started', '?')}")


def _pid_alive(pid: int) -> bool:
    from .files import pid_alive
    return pid_alive(pid)


class RunLock:
    """The run directory's lock, held for the life of a run (rank 0 under torchrun).

    A POSIX record lock (``lockf``) on ``run.lock``, which the kernel releases when the
    process ends however it ends, so a lock left by a killed process is never mistaken for a
    live one. Not ``flock``: an flock is shared with forked children, so data-loader workers
    outliving a SIGKILLed trainer for a moment would keep the run locked; a record lock
    belongs to the process alone (so two runs inside one process are not told apart, and
    nothing else in the process may open and close ``run.lock``). The file names the holder
    (pid, host, start time) for the error the next process prints. Where the filesystem has no locks, the recorded pid is
    checked instead (same host only).
    """

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run: RunDir) -> tuple["RunLock", str | None]:
        """Lock ``run``. Returns the lock and a note when a dead process's lock was taken
        over. Raises :class:`RunDirError` naming the holder when a live process has it."""
        run.root.mkdir(parents=True, exist_ok=True)
        path = run.lock_file
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held, prev = False, _read_lock(fd)
            except OSError as e:
                prev = _read_lock(fd)
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    held = True
                else:  # no locks on this filesystem: trust a live pid on this host
                    pid = prev.get("pid")
                    held = isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid) \
                        and prev.get("host") == socket.gethostname()
            if held:
                raise RunDirError(
                    f"{run.root} is being trained into by another process ({_describe(prev)});"
                    " two runs in one directory would overwrite each other's checkpoints and "
                    "logs. Wait for it to finish or stop it, or choose another --out "
                    f"directory (the lock: {path})")
            note = None
            if prev:
                note = (f"note: took over the lock of a process that is no longer running "
                        f"({_describe(prev)}); it ended without releasing it (killed?)")
            info = json.dumps(_lock_info()).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd), note

    def release(self) -> None:
        """Empty the lock file and unlock (closing the file releases the lock; the file
        stays: removing a locked file races with a newcomer)."""
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)


def _read_lock(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "started": "? (unreadable lock file)"}
    return info if isinstance(info, dict) else {}
