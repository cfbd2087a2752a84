"""Stopping on a preemption signal: finish the step, checkpoint, say how to resume.

SLURM, Kubernetes and cloud spot preemption send SIGTERM (then SIGKILL after a grace
period); Ctrl-C sends SIGINT; Lightning-style requeue scripts send SIGUSR1. For the life of
the training loop :class:`StopSignals` replaces the handlers of these three signals with one
that only records the request: the loop asks :meth:`StopSignals.agreed` once per step, the
current step and any checkpoint being written complete, and the loop's normal end writes the
final checkpoint, ``summary.json`` (``status: interrupted``) and the report. The command
then exits ``EXIT_INTERRUPTED``; rerunning it resumes bit for bit.

- **A second signal stops at once**: exit ``128 + signal`` (what a shell reports for death
  by that signal), without a checkpoint of the current step; the newest checkpoint is intact
  because checkpoints are atomic. A second signal within ``SAME_EVENT_S`` of the first is
  taken as the same request: Ctrl-C reaches torchrun and its workers together, and torchrun
  forwards it to the workers once more.
- **Under torchrun every rank stops at the same step**, whether the signal reached one rank
  or all of them: each pass of the loop all-reduces the local request (MAX, in the same
  collective as the time budget's clock), so the ranks agree before anyone acts (the design
  rule of distributed.py).
- **Nothing is clobbered for good**: handlers are installed only in the main thread (Python
  allows no other), and the previous ones are restored when the loop ends. Data-loader
  workers ignore the stop signals (:func:`ignore_in_worker`, their ``worker_init_fn``), so a
  signal to the whole process group, as launchers send it, stops the run the same way.

The handler writes with ``os.write`` (async-signal-safe, and no re-entrant ``print`` into a
stream the main thread may be in the middle of), starting on a new line so the message is
not glued to the progress bar.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from .. import distributed

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# exit status of a run stopped by one of STOP_SIGNALS after writing its checkpoint
# (resumable: rerun the same command); 0/2/3/4/5 are the CLI's and distributed.py's
EXIT_INTERRUPTED = 6
SAME_EVENT_S = 1.0


class TrainingInterrupted(Exception):
    """The run stopped on a signal after a verified checkpoint of the stop step (or of no
    step at all, if none was trained). Rerunning the same command resumes it. Exit code 6.

    Attributes:
        signal: the signal's name (``SIGTERM``, ``SIGINT``, ``SIGUSR1``).
        step: the step the run stopped at.
        checkpoint: the checkpoint to resume from (None: no step was ever saved).
        result: the run's :class:`~steadydiff.trainer.loop.RunResult` so far.
    """

    def __init__(self, signame: str, step: int, checkpoint: Any, result: Any = None):
        self.signal, self.step, self.checkpoint, self.result = signame, step, checkpoint, result
        where = f"; checkpoint {checkpoint}" if checkpoint else "; no checkpoint was written"
        super().__init__(f"interrupted by {signame} at step {step}{where}")


class StopSignals:
    """Context manager: while active, SIGTERM/SIGINT/SIGUSR1 request a stop at the next step.

    ``requested`` is this process's first signal (a number), ``None`` until one arrives.
    ``rank`` (torchrun) prefixes the messages, which every rank that got a signal prints.
    """

    def __init__(self, rank: int | None = None) -> None:
        self.who = f"rank {rank}: " if rank is not None else ""
        self.requested: int | None = None
        self._first_at = 0.0
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked data-loader worker: the main process stops it
            return
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self._first_at = signum, time.monotonic()
            _say(f"\n{self.who}{name} received: stopping after this step, with a checkpoint "
                 "(a second signal stops at once)\n")
        elif time.monotonic() - self._first_at > SAME_EVENT_S:
            _say(f"\n{self.who}{name} received again: stopping now, without a checkpoint of "
                 "this step; the newest checkpoint is intact. Rerun the same command to "
                 "resume.\n")
            os._exit(128 + signum)

    def agreed(self, device: torch.device, seconds: float = 0.0) -> tuple[int | None, float]:
        """What every rank acts on: the stop request, the largest signal number any rank
        has received (None: no stop), and the training seconds, the largest of the ranks'
        ``seconds`` (the time budget's clock, trainer/budget.py). Single process: this
        process's values, no collective. Under torchrun: one all-reduce of two float64s on
        the CPU (``distributed.control_group``, gloo: no device sync under NCCL either).
        ``device`` is kept for callers; the agreement does not touch it."""
        if not distributed.active():
            return self.requested, seconds
        flag = torch.tensor([self.requested or 0, seconds], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=distributed.control_group())
        signum, agreed_seconds = flag.tolist()  # a CPU tensor: no device read
        return int(signum) or None, agreed_seconds


def ignore_in_worker() -> None:
    """Make this process (a data-loader worker) ignore the stop signals.

    A launcher's stop (SLURM ``scancel``, Kubernetes, ``kill -- -PGID``, Ctrl-C in a
    terminal) reaches every process of the job, the data-loader workers too. torch's worker
    loop installs its own SIGTERM handler, which ends the worker unless its parent sent the
    signal, and the main process then fails with "DataLoader worker ... killed by signal:
    Terminated" instead of checkpointing; a spawned worker would die of SIGUSR1 (default
    action) or raise KeyboardInterrupt on SIGINT. Called from the loader's
    ``worker_init_fn``, after torch installed its handlers, so the main process alone acts on
    the signal (:class:`StopSignals`) and ends the workers as it always does. A worker whose
    main process is gone still exits: torch's worker loop watches its parent.
    """
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _say(text: str) -> None:
    try:
        os.write(2, text.encode())
    except OSError:
        pass


__all__ = ["EXIT_INTERRUPTED", "STOP_SIGNALS", "StopSignals", "TrainingInterrupted",
           "ignore_in_worker", "signal_name"]
