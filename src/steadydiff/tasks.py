"""The tasks a user starts from, and the commented config each starts with.

``steadydiff init TASK`` writes the task's config (a shipped file of ``configs/``: only the
keys that task's users set, each with a comment; every other key keeps its default, which
``train --dry-run --print-config`` shows). The table below is the one list of tasks: the
README's "start here" paths, ``init``'s choices and the config-minimality test read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Task:
    name: str
    config: str  # file name under configs/
    what: str
    #: the keys its users must set (they may equal a default: a path, a model)
    must_set: tuple[str, ...] = ()


TASKS: tuple[Task, ...] = (
    Task("scratch", "folder_unet.yaml", "a UNet from scratch on your own folder of images",
         ("data.dataset", "data.path", "data.image_size", "model.kind")),
    Task("digits", "digits_cond.yaml", "the quick start: a class-conditional UNet on the "
         "bundled digits (about 2 minutes on a CPU)", ("data.dataset", "data.image_size")),
    Task("dit", "dit.yaml", "a class-conditional DiT on the bundled digits",
         ("data.dataset", "data.image_size")),
    Task("lora", "sd_lora.yaml", "a LoRA on a local Stable Diffusion 1.x/2.x or SDXL model",
         ("data.dataset", "data.path", "data.image_size", "model.pretrained")),
    Task("sd3-lora", "sd3_lora.yaml", "a LoRA on a local SD3 / SD3.5 model",
         ("data.dataset", "data.path", "data.image_size", "model.pretrained")),
    Task("flux-lora", "flux_lora.yaml", "a LoRA on a local FLUX.1 (dev, schnell) model",
         ("data.dataset", "data.path", "data.image_size", "model.pretrained")),
    Task("textual-inversion", "sd_textual_inversion.yaml", "a textual-inversion embedding "
         "(a new token) on a local Stable Diffusion 1.x/2.x or SDXL model",
         ("data.dataset", "data.path", "data.image_size", "model.pretrained")),
    Task("controlnet", "sd_controlnet.yaml", "a ControlNet on a local Stable Diffusion model "
         "and paired conditioning images", ("data.dataset", "data.path", "data.image_size",
                                            "model.pretrained")),
)

#: keys every task's users set, whatever their value (the issue-32 dozen)
ALWAYS_SET = ("train.steps", "train.batch_size", "optim.lr", "adapter.kind", "adapter.rank",
              "adapter.alpha", "data.trigger", "sample.prompts", "train.sample_every",
              "train.checkpoint_every")


def names() -> list[str]:
    return [t.name for t in TASKS]


def get(name: str) -> Task:
    for t in TASKS:
        if t.name == name:
            return t
    raise ValueError(f"unknown task {name!r}; valid: {', '.join(names())}")


def configs_dir() -> Path:
    """Where the shipped configs are: the package's copy in an installed wheel, else the
    repository's ``configs/`` (an editable install, a clone)."""
    here = Path(__file__).resolve().parent
    for d in (here / "configs", here.parents[1] / "configs"):
        if d.is_dir():
            return d
    raise FileNotFoundError(f"the shipped configs are missing (looked in {here / 'configs'} "
                            f"and {here.parents[1] / 'configs'}); reinstall steadydiff")


def template(name: str) -> str:
    """The commented config of task ``name``, as shipped."""
    t = get(name)
    return (configs_dir() / t.config).read_text()


__all__ = ["ALWAYS_SET", "TASKS", "Task", "configs_dir", "get", "names", "template"]
