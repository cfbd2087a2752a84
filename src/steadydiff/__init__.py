"""steadydiff: training diffusion models that do not crash.

Public API:
    steadydiff.train(config, dataset=None, out_dir=...)   train (or resume) a run
    steadydiff.load(checkpoint)                           a trained model ready for sampling
    steadydiff.load_config(path, overrides)               the typed, validated config tree
    steadydiff.Guard(model, optimizer, ...)               the stability guard, for any loop
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports on first use
    from .api import Pipeline, load, train
    from .config import Config, ConfigError, load_config
    from .guard import Guard, GuardAbort
    from .trainer.preempt import TrainingInterrupted

__all__ = ["Config", "ConfigError", "Guard", "GuardAbort", "Pipeline", "TrainingInterrupted",
           "load", "load_config", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Everything is imported lazily: the CLI's --help and --version import this package and
    # must not pay for pydantic (config) or torch (the rest).
    if name in ("Config", "ConfigError", "load_config"):
        from . import config
        return getattr(config, name)
    if name in ("train", "load", "Pipeline"):
        from . import api
        return getattr(api, name)
    if name in ("Guard", "GuardAbort"):
        from . import guard
        return getattr(guard, name)
    if name == "TrainingInterrupted":
        from .trainer import preempt
        return preempt.TrainingInterrupted
    raise AttributeError(f"module 'steadydiff' has no attribute {name!r}")
