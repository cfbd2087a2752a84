"""What a run shows and leaves where users look: the status output in logs and terminals,
the CLI's --version and --help, the permissions of checkpoint files, incidents.jsonl.

Each test here failed on the code before it (docs/RELIABILITY.md, "What users expect around
it"): tqdm's carriage-return line in CI logs, "(default: None)" in --help, safetensors files
left 0600 by their temporary file, no incidents.jsonl after a healthy run.
"""

import argparse
import fcntl
import os
import pty
import re
import stat
import struct
import subprocess
import sys
import termios
import threading
import tomllib
from pathlib import Path

import pytest

import steadydiff
from steadydiff.cli import _parser, main
from steadydiff.config import load_config
from steadydiff.doctor import diagnose
from steadydiff.inspect.read import read_run
from steadydiff.inspect.verdict import verdict
from steadydiff.rundir import RunDir

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

ROOT = Path(__file__).resolve().parent.parent
STATUS = re.compile(r"^train step (\d+)/(\d+) \| loss \d\.\d{4} \| gnorm ", re.M)


def tiny(*extra):
    return load_config(None, TINY_MODEL + ["train.steps=4", "train.checkpoint_every=2",
                                           "logging.log_every=2", *extra])


# --------------------------------------------------------------------------- status output


def test_status_lines_without_a_terminal(tmp_path, capsys):
    """stderr is a pipe/file (CI, SLURM, capsys): one plain line every log_every steps, no
    carriage-return progress bar."""
    assert not sys.stderr.isatty()
    steadydiff.train(tiny("logging.progress=true"), out_dir=tmp_path / "run")
    err = capsys.readouterr().err
    assert "\r" not in err, err[:500]
    assert [(int(a), int(b)) for a, b in STATUS.findall(err)] == [(2, 4), (4, 4)], err
    assert "s/step" in err


def test_progress_false_prints_no_status(tmp_path, capsys):
    steadydiff.train(tiny(), out_dir=tmp_path / "run")  # TINY_MODEL: logging.progress=false
    assert not STATUS.search(capsys.readouterr().err)


def _train_on_a_terminal(tmp_path, cols: int) -> str:
    """Run the CLI with stderr on a pseudo-terminal ``cols`` wide; what it showed there."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny("logging.progress=true", "logging.report=false").to_yaml())
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if cols else 0, cols, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "steadydiff", "train", str(cfg),
                          "--out", str(tmp_path / "run")],
                         stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks: list[bytes] = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert p.wait(timeout=300) == 0
    reader.join(timeout=10)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal(tmp_path):
    """stderr is a terminal: the tqdm bar (redrawn with \\r), not the plain lines."""
    out = _train_on_a_terminal(tmp_path, cols=100)
    assert "\rtrain:" in out and "4/4" in out and "it/s" in out, out[-2000:]
    assert not STATUS.search(out), out[-2000:]


def test_status_lines_on_a_terminal_without_a_size(tmp_path):
    """`script` run from a job, a container's pty: a terminal 0 columns wide, where tqdm
    draws nothing at all. The plain lines instead."""
    out = _train_on_a_terminal(tmp_path, cols=0)
    assert [(int(a), int(b)) for a, b in STATUS.findall(out)] == [(2, 4), (4, 4)], out[-2000:]


# --------------------------------------------------------------------------- CLI


def test_version():
    r = subprocess.run([sys.executable, "-m", "steadydiff", "--version"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"steadydiff {steadydiff.__version__}"
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["version"] == steadydiff.__version__  # one version, not two that drift


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_has_help():
    parsers = {"steadydiff": _parser(), **_commands()}
    missing = [(cmd, a.option_strings or a.dest) for cmd, p in parsers.items()
               for a in p._actions if not a.help
               and not isinstance(a, argparse._SubParsersAction)]  # its commands have help
    assert missing == []
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest: bool(c.help) for c in sub._choices_actions} == \
        {cmd: True for cmd in _commands()}  # each command's line in `steadydiff --help`


@pytest.mark.parametrize("cmd", list(_commands()))
def test_help_shows_each_default_once_and_never_none(cmd, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per option: no wrapping to split a match
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out, out
    for line in out.splitlines():
        assert len(re.findall(r"\bdefault\b", line, re.I)) <= 1, line


# --------------------------------------------------------------------------- run files


def test_checkpoint_files_follow_the_umask(tmp_path):
    """Every file of a checkpoint gets the mode any other file of the run gets (safetensors
    wrote 0600 through its temporary file, torch.save 0644)."""
    old = os.umask(0o002)  # a shared group directory
    try:
        steadydiff.train(tiny("train.steps=2"), out_dir=tmp_path / "run")
    finally:
        os.umask(old)
    run = RunDir(tmp_path / "run")
    mode = stat.S_IMODE(run.config.stat().st_mode)
    assert mode == 0o664
    files = [p for p in run.checkpoints.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "ema.safetensors", "optimizer.pt",
                                       "manifest.json", "latest"}
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == \
        {p.name: oct(mode) for p in files}


def test_healthy_run_writes_an_empty_incidents_file(tmp_path):
    res = steadydiff.train(tiny(), out_dir=tmp_path / "run")
    run = RunDir(tmp_path / "run")
    assert res.incidents == 0
    assert run.incidents.is_file() and run.incidents.read_text() == ""
    # the report and the doctor read an empty file as "no incidents"
    log = read_run(run.root)
    assert log.incidents == [] and not log.problems
    assert verdict(log).state == "healthy"
    d = diagnose(run.root, probe=False)
    assert not [c for c in d.causes if c.check == "incidents"]
    assert "incidents" in d.checks


def test_incidents_file_kept_on_resume(tmp_path):
    """Creating the file at start must not truncate a resumed run's incidents."""
    nan = "faults=[{kind: nan_batch, step: 1}]"
    steadydiff.train(tiny("train.steps=2", nan), out_dir=tmp_path / "run")
    run = RunDir(tmp_path / "run")
    before = run.incidents.read_text()
    assert '"bad_batch"' in before
    res = steadydiff.train(tiny(nan), out_dir=tmp_path / "run")
    assert res.resumed_from is not None and res.steps == 4
    assert run.incidents.read_text() == before
