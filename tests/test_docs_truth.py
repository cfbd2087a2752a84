"""The docs stay true: every `steadydiff COMMAND --flag` and every config key that README.md
and docs/*.md name in code (inline code and code blocks) exists in the CLI and the config."""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path

import pytest

from steadydiff.cli import _parser
from steadydiff.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# file names that look like keys (train.py, sample.png) are not keys
FILE_EXT = re.compile(r"\.(py|ya?ml|json|jsonl|md|png|jpe?g|webp|npz|pt|pth|bin|ckpt|txt|"
                      r"safetensors|html|toml|log|sh|csv)$")


def _code(text: str) -> tuple[list[str], list[str]]:
    """The code a page shows: shell-like lines of fenced blocks that are not Python or
    YAML, and the inline `spans` of its prose."""
    lines: list[str] = []
    spans: list[str] = []
    parts = re.split(r"^[ \t]*```(.*)$", text, flags=re.M)
    segments, langs = parts[0::2], parts[1::2]  # segment k (odd) follows fence k-1
    for k, seg in enumerate(segments):
        if k % 2 == 0:
            spans += re.findall(r"`([^`\n]+)`", seg)
        elif langs[k - 1].strip().lower() not in ("python", "py", "yaml", "yml", "json"):
            lines += [ln.strip() for ln in seg.splitlines() if ln.strip()]
    return lines, spans


def _commands() -> dict[str, argparse.ArgumentParser]:
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _keys(cls=Config, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, field in cls.model_fields.items():
        out.add(prefix + name)
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            out |= _keys(sub, f"{prefix}{name}.")
    return out


SECTIONS = set(Config.model_fields)
# keys whose value is a free mapping (their sub-keys are the user's)
OPEN: set[str] = set()
# named on purpose though they are no key
NOT_KEYS = {"train.stepz": "the docs' example of an unknown key and its error",
            "section.key": "the placeholder of --set's syntax",
            "adapter.conditioning": "a field of an adapter checkpoint's state.json"}
KEYS = _keys()


COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S* )*(?:\S*torchrun .*?-m |python -m |\S*/)?"
                     r"steadydiff ([a-z][a-z_-]*)(.*)$")
KEY = r"[a-z_]+(?:\.[a-z_0-9]+)+"


def _named(page: Path):
    lines, spans = _code(page.read_text())
    for snippet in lines + spans:
        m = COMMAND.match(snippet)
        if m:
            yield "command", m.group(1), m.group(2)
        for k in re.findall(rf"--set[= ]+({KEY})=", snippet):
            yield "key", k, ""
    for span in spans:  # a span that is a key: `optim.lr`, `optim.lr=1e-4`, `optim.lr: 1e-4`
        m = re.fullmatch(rf"({KEY})((?:=|: ).*)?", span.strip())
        if not m or m.group(1).split(".")[0] not in SECTIONS or FILE_EXT.search(m.group(1)):
            continue
        key = m.group(1)
        # a bare `guard.step` may be Python (the Guard's method, model.module): a bare span
        # is taken for a key when it is one, a key's typo, or under a real key (model.unet.x)
        if (m.group(2) or key in KEYS or difflib.get_close_matches(key, KEYS, n=1, cutoff=0.85)
                or ".".join(key.split(".")[:2]) in KEYS and key.count(".") > 1
                and ".".join(key.split(".")[:2]) not in OPEN):
            yield "key", key, ""


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_command_flag_and_key_the_docs_name_exists(page):
    commands = _commands()
    wrong: list[str] = []
    for what, name, rest in _named(page):
        if what == "key":
            if name not in KEYS and name not in NOT_KEYS:
                wrong.append(f"config key {name}")
            continue
        if name not in commands:
            wrong.append(f"command `steadydiff {name}`")
            continue
        valid = _options(commands[name]) | {"--help", "-h"}
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if flag not in valid:
                wrong.append(f"`steadydiff {name} {flag}`")
    assert not wrong, f"{page.name} names what does not exist: " + ", ".join(sorted(set(wrong)))


def test_the_check_itself_finds_what_is_wrong():
    page = "run `steadydiff trian x` or `steadydiff train c.yaml --sett a=1`, `optim.lrr=2`\n"
    found = list(_named_text(page))
    assert ("command", "trian", " x") in found and ("key", "optim.lrr", "") in found
    assert ("command", "train", " c.yaml --sett a=1") in found
    assert "optim.lrr" not in KEYS and "optim.lr" in KEYS and "model.unet.channels" in KEYS


def _named_text(text: str):
    tmp = Path(__file__).parent / "__doc_check_probe.md"
    tmp.write_text(text)
    try:
        yield from _named(tmp)
    finally:
        tmp.unlink()
