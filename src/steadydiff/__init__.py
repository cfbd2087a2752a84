"""steadydiff: training diffusion models that do not crash.

Public API:
    steadydiff.train(config, dataset=None, out_dir=...)   train (or resume) a run
    steadydiff.load(checkpoint)                           a trained model ready for sampling
    steadydiff.load_config(path, overrides)               the typed, validated config tree
    steadydiff.Guard(model, optimizer, ...)               the stability guard, for any loop
"""

from .config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "Guard", "GuardAbort", "Pipeline", "TrainingInterrupted",
           "load", "load_config", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported lazily so `import steadydiff.config` (the CLI's --help, --dry-run) stays light.
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
