"""torch.compile of the training forward (``train.compile``; docs/compile.md).

One compiled module runs the training forward and backward only: the step's micro-batches
and the guard's rerun of a step on the samples it kept. It shares its parameters with the
plain module ``state.model``, and everything else uses that one:

- checkpoints hold the plain module's keys (never torch.compile's ``_orig_mod.`` prefix), so
  a run saved with compile on resumes with it off and the other way round;
- EMA averages the plain module's parameters (the same tensors the compiled graph reads);
- sample grids, evaluation, the guard's provenance replays and its health probes run the
  plain module, so the forward hooks they register on its submodules fire: a compiled graph
  runs the hooks it was traced with, and dynamo does not notice hooks added later
  (``torch._dynamo.config.skip_nnmodule_hook_guards``);
- for the same reason a step whose fault injection hooks modules (``fp16_overflow``,
  ``transient_nan``, ``attn_logit_overflow``: docs/faults.md) runs the plain module.

Under torchrun the DDP wrapper is what gets compiled (``torch.compile(DDP(model))``, the
order PyTorch documents): dynamo splits the graph at DDP's gradient buckets, so the
all-reduce still overlaps the backward, and ``no_sync`` keeps working.

Compilation is lazy: the first step (and the first step at a new micro-batch size: an OOM
backoff, the guard's rerun on fewer samples) traces and builds kernels, seconds to minutes
on CPU; later steps reuse them. The CPU figures are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError, TrainConfig

__all__ = ["CompileError", "check_toolchain", "compile_failure", "compile_forward",
           "training_module"]


class CompileError(ConfigError):
    """torch.compile cannot run here, or failed on the model (exit code 2). The message says
    why and that ``train.compile=false`` trains without it."""


OFF_HINT = ("set train.compile=false to train without torch.compile (a run resumes with it "
            "on or off; docs/compile.md)")


def check_toolchain(tcfg: TrainConfig, device: torch.device) -> None:
    """What inductor needs to build kernels on ``device``: a C++ compiler on CPU (``$CXX``,
    else ``g++``), Triton on CUDA. Checked before the run builds anything (and by the dry
    run), since a compile fails only at the first step otherwise.

    Raises:
        CompileError: the compiler or Triton is missing.
    """
    if not tcfg.compile or tcfg.compile_backend != "inductor":
        return
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()  # runs `CXX --version`
        except Exception as e:  # InvalidCxxCompiler; the module is private: any failure
            raise CompileError(
                f"train.compile=true: on CPU torch.compile's inductor backend builds C++ "
                f"kernels and needs a C++ compiler, but none works here ({e}); install one "
                "(e.g. `apt-get install g++`, or point $CXX at it), or " + OFF_HINT) from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileError("train.compile=true: on CUDA torch.compile's inductor backend "
                               "generates Triton kernels, but triton is not importable; "
                               "install the triton that matches your torch, or " + OFF_HINT)


def compile_forward(state) -> None:
    """Set ``state.compiled`` to the compiled training module (the DDP wrapper under
    torchrun, else the model) when ``train.compile``, else None. Call it after any DDP
    wrapping; nothing is compiled until the first step calls it."""
    tcfg = state.cfg.train
    if not tcfg.compile:
        state.compiled = None
        return
    module = state.ddp if state.ddp is not None else state.model
    mode = {"mode": tcfg.compile_mode} if tcfg.compile_backend == "inductor" else {}
    state.compiled = torch.compile(module, backend=tcfg.compile_backend, **mode)


def training_module(state, *, local: bool = False, hooked: bool = False) -> nn.Module:
    """The module a training forward calls.

    Args:
        local: a replay or probe on this rank: the plain model (no DDP collectives, no
            compiled graph, its hooks fire).
        hooked: fault injection hooked modules of the plain model for this forward: the
            uncompiled module (DDP wrapper or model), whose hooks fire.
    """
    if local:
        return state.model
    if state.compiled is not None and not hooked:
        return state.compiled
    return state.ddp if state.ddp is not None else state.model


def compile_failure(e: BaseException, tcfg: TrainConfig) -> CompileError | None:
    """``e`` as a :class:`CompileError` when it is torch.compile failing (dynamo tracing,
    inductor lowering, the C++/Triton build of a kernel) in a run with ``train.compile``;
    None otherwise."""
    if not tcfg.compile or not isinstance(e, RuntimeError):
        return None
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    if not isinstance(e, (TorchDynamoException, CppCompileError, InvalidCxxCompiler)):
        return None
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return CompileError(
        f"torch.compile failed on the model (train.compile=true, backend "
        f"{tcfg.compile_backend}, mode {tcfg.compile_mode}): {type(e).__name__}: {first}; "
        f"{OFF_HINT}; train.compile_backend=aot_eager tells whether the model traces "
        "without inductor")
