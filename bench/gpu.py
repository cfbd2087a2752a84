"""GPU benchmark: a bare PyTorch loop against steadydiff's step with the guard off and on,
for a UNet and a DiT-B/2-shaped model on a 32x32x4 latent, in bf16 and fp16, eager and
compiled, side by side in one process; with host syncs per step, peak memory and the model
FLOPs utilisation (MFU). Ready for the day a GPU is available: run it whenever one is.

    python bench/gpu.py                  # on one GPU: the whole grid in under 5 minutes
    python bench/gpu.py --tiny           # tiny widths, few steps (the default without CUDA)
    python bench/gpu.py --models dit --precisions bf16 --compile on --budget-s 120

What runs. Each group (model, precision, compile) builds three variants from one
initialisation and times them interleaved (bare, off, guard, bare, off, guard, ...) over the
same pre-made batches, already on the device (random latents ~ N(0, 1); data loading is not
measured):

- ``bare``:  bench/throughput.py's hand-written loop (same model, AdamW groups, objective,
  clipping, EMA lerp, ``.item()`` at each logging tick) with autocast, and for fp16 the
  standard GradScaler sequence (scale, unscale, clip, step, update);
- ``off`` / ``guard``: steadydiff's own ``train_step`` plus what ``loop.run`` does per step
  (bench/throughput.py's ``TrainerVariant``), the guard off / on.

Models: ``unet`` is configs/folder_unet.yaml's UNet (128 wide, x1/2/2/2, attention at 16 and
8: what that config trains from scratch) at batch 64; ``dit`` is configs/dit.yaml with
``model.dit.preset=B`` and patch 2 (hidden 768, depth 12, 12 heads: DiT-B/2), 1000 classes,
at batch 256 (DiT's global batch). The latent has 4 channels, which ``data.channels`` (1 or 3:
the pixel datasets) does not admit; nothing on the training step reads that key but the model
builder, so the bench sets it past validation (:func:`latent_cfg`).

What is measured, per variant:

- ms/step and images/s: the median of ``--repeats`` timed runs of ``--steps`` steps (the
  device synchronised around each run); ``--steps`` is planned from a short timed probe so
  that the whole grid fits ``--budget-s``; groups that would not fit are skipped, and said so;
- host syncs per step: on CUDA counted in one extra untimed run under
  ``torch.cuda.set_sync_debug_mode("warn")`` (each warning one sync) plus the deliberate reads
  through ``steadydiff.hostsync`` (which lifts the debug mode for them), over a multiple of
  the periodic events' periods (:func:`sync_window`); on every device the
  ``hostsync.reads()`` difference over the timed steps;
- peak memory (CUDA): the variant's own resident memory (weights, gradients, AdamW moments,
  EMA, guard snapshots: allocated while it was built and warmed up) plus its largest step peak
  above that (``torch.cuda.max_memory_allocated``, reset before each run), so that the other
  variants resident in the same process are not counted; n/a on a CPU;
- MFU: the FLOPs of one forward + backward of the model at the batch size
  (``torch.utils.flop_counter.FlopCounterMode``, counted once, untimed; the optimizer, EMA and
  elementwise work are not counted, as usual for MFU) / step time / the GPU's dense bf16/fp16
  peak (:data:`PEAK_TFLOPS`, or ``--peak-tflops``); on a CPU the achieved GFLOP/s only.

Compile: the bare loop compiles its model (``model.compile()``); the trainer variants use
``train.compile`` where this version's config has that key (set up as ``loop.run`` does, by
``trainer.compilation.compile_forward``: the training forward and backward compiled, the
guard's replays and probes on the plain module), and otherwise the bench compiles the whole
``state.model`` in place (``compile_source`` in the JSON says which; the table marks it
``on (bench)``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: one busy thread each

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import REPO, BareVariant, TrainerVariant, env_info, load_cfg  # noqa: E402

LATENT_CHANNELS = 4

# model -> (config file, overrides, batch size on a GPU)
MODELS: dict[str, tuple[Path, dict[str, Any], int]] = {
    "unet": (REPO / "configs" / "folder_unet.yaml", {}, 64),
    "dit": (REPO / "configs" / "dit.yaml",
            {"model.dit.preset": "B", "model.dit.patch_size": 2, "model.num_classes": 1000}, 256),
}
# --tiny: narrow, shallow versions of each shape, for a CPU (CI) in seconds
TINY: dict[str, dict[str, Any]] = {
    "unet": {"model.unet.channels": 8, "model.unet.channel_mult": [1, 2],
             "model.unet.num_res_blocks": 1, "model.unet.attention_resolutions": [8],
             "model.unet.head_channels": 8, "model.unet.norm_groups": 4},
    "dit": {"model.dit.depth": 2, "model.dit.hidden_size": 64, "model.dit.num_heads": 2,
            "model.num_classes": 10},
}
TINY_SIZE, TINY_BATCH = 16, 8
SIZE = 32

# Dense (no 2:4 sparsity) tensor-core peak TFLOPS, bf16 and fp16 with fp32 accumulation, from
# the vendors' datasheets and architecture whitepapers (half the "with sparsity" figure where
# a datasheet gives only that); None: no native support. First match of the regular
# expression in torch.cuda.get_device_name() wins (so PCIe/NVL before SXM).
PEAK_TFLOPS: list[tuple[str, float | None, float | None]] = [
    (r"H100.*PCIe", 756.5, 756.5),
    (r"H100.*NVL", 835.5, 835.5),
    (r"H100|GH200", 989.5, 989.5),      # SXM5 ("H100 80GB HBM3")
    (r"H200.*NVL", 835.5, 835.5),
    (r"H200", 989.5, 989.5),            # SXM
    (r"A100", 312.0, 312.0),            # SXM4 and PCIe alike
    (r"L40S", 362.0, 362.0),
    (r"\bL4\b", 121.0, 121.0),
    (r"\bA10\b", 125.0, 125.0),
    (r"RTX 4090", 165.2, 165.2),
    (r"RTX 3090", 71.0, 71.0),
    (r"RTX A6000", 154.8, 154.8),
    (r"V100.*PCIE", None, 112.0),
    (r"V100", None, 125.0),             # SXM2
    (r"\bT4\b", None, 65.0),
]


def peak_tflops(name: str | None, precision: str) -> float | None:
    """The datasheet peak of GPU ``name`` in ``precision``; None when unknown (or fp32)."""
    if not name or precision not in ("bf16", "fp16"):
        return None
    for pat, bf16, fp16 in PEAK_TFLOPS:
        if re.search(pat, name, re.IGNORECASE):
            return bf16 if precision == "bf16" else fp16
    return None


# --------------------------------------------------------------------------- setup


def latent_cfg(cfg, channels: int = LATENT_CHANNELS):
    """``cfg`` with ``data.channels = channels``, set past validation: the key admits the pixel
    datasets' 1 or 3, a latent has 4, and on the training step only the model builder reads
    it. Apply it after every validated change (``replace`` would reject it)."""
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"channels": channels})})


def model_cfg(name: str, *, tiny: bool, batch: int | None, precision: str, device):
    """The validated config of model ``name`` (without the latent channels)."""
    from steadydiff.config import replace
    path, over, gpu_batch = MODELS[name]
    cfg = load_cfg(path, [])
    changes = {**over, **(TINY[name] if tiny else {}),
               "data.image_size": TINY_SIZE if tiny else SIZE, "data.hflip": False,
               "train.batch_size": batch or (TINY_BATCH if tiny else gpu_batch),
               "train.precision": precision, "train.num_threads": 0}
    from steadydiff.trainer.precision import native_support
    if not native_support(precision, device):
        changes["train.allow_slow_precision"] = True
    cfg = replace(cfg, changes)
    if hasattr(cfg.optim, "fused"):  # the `auto` speed keys resolved here, as a run does,
        from steadydiff.trainer import speed  # so build_state has nothing to re-validate
        cfg, _ = speed.resolve(cfg, torch.device(device) if isinstance(device, str)
                               else device)
    return cfg


def has_compile_key(cfg) -> bool:
    return "compile" in type(cfg.train).model_fields


def make_batches(cfg, n: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``n`` batches (x, y, idx) of random latents ~ N(0, 1), labels, indices; on the device
    (the indices on the host, as the trainer's loader gives them)."""
    g = torch.Generator().manual_seed(cfg.train.seed)
    b, s, k = cfg.train.batch_size, cfg.data.image_size, max(1, cfg.model.num_classes)
    return [(torch.randn(b, LATENT_CHANNELS, s, s, generator=g).to(device),
             torch.randint(0, k, (b,), generator=g).to(device),
             torch.arange(i * b, (i + 1) * b)) for i in range(n)]


def _cpu_attention_flops() -> dict:
    """FlopCounterMode counts CUDA's attention kernels but not the CPU one: give it theirs
    (same arguments: q, k, v ...; backward: grad_out, q, k, v ...)."""
    from torch.utils import flop_counter as fcm
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or bwd is None or not hasattr(fcm, "sdpa_flop"):
        return {}

    def raw(f):  # the module's formulas already take tensors (shape-wrapped on registration)
        def g(*args, **kwargs):
            return f(*args, **kwargs)
        g._get_raw = True  # type: ignore[attr-defined]
        return g
    return {fwd: raw(fcm.sdpa_flop), bwd: raw(fcm.sdpa_backward_flop)}


def step_flops(cfg, batch: tuple[torch.Tensor, ...], device: torch.device,
               count_on: int = 8) -> int:
    """FLOPs of one forward + backward of ``cfg``'s model on ``batch`` (FlopCounterMode:
    matmuls, convolutions, attention; counted once, on a throw-away eager copy). Every
    counted operation's FLOPs are proportional to the batch, so they are counted on the
    first ``count_on`` samples and scaled (DiT-B/2's 256 at once in fp32 would hold tens of
    GB of activations)."""
    n = batch[0].shape[0]
    k = min(n, count_on)
    batch = tuple(t[:k] for t in batch)
    from torch.utils.flop_counter import FlopCounterMode

    from steadydiff.diffusion import diffusion_loss, make_schedule
    from steadydiff.models import build_model
    model = build_model(cfg.model, image_size=cfg.data.image_size,
                        channels=cfg.data.channels).to(device)
    y = batch[1] if cfg.model.num_classes else None
    gen = torch.Generator(device=device).manual_seed(0)
    with FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as fc:
        loss = diffusion_loss(model, batch[0], y, make_schedule(cfg.diffusion), cfg.diffusion,
                              gen).loss
        loss.backward()
    return int(fc.get_total_flops()) * n // k


# --------------------------------------------------------------------------- variants


class Bare(BareVariant):
    """bench/throughput.py's bare loop with autocast and, for fp16, the GradScaler."""

    def __init__(self, cfg, device: torch.device, init_state: dict, compile: bool):
        super().__init__(cfg, device, init_state)
        self.precision = cfg.train.precision
        self.scaler = torch.amp.GradScaler(device.type) if self.precision == "fp16" else None
        self.conditional = cfg.model.num_classes > 0
        self.compile_source = "bench" if compile else None
        if compile:
            self.model.compile()  # in place: the state dict keeps its keys

    def forward(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        from steadydiff.trainer.precision import autocast
        with autocast(self.precision, self.device):
            return super().forward(x, y if self.conditional else None)

    def update(self, loss: torch.Tensor) -> None:
        scaler = self.scaler
        if scaler is None:
            return super().update(loss)
        scaler.scale(loss).backward()
        scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        scaler.step(self.opt)  # skips the step on inf/NaN gradients (a host sync)
        scaler.update()


class Trainer(TrainerVariant):
    """steadydiff's step: bench/throughput.py's ``TrainerVariant`` (its ``run`` is the loop
    body of ``loop.run``), set up here on the latent config, which ``replace`` (in
    ``TrainerVariant.__init__``) would refuse; optionally compiled."""

    strict = False  # count fp16's scaler skips, do not fail on them

    def __init__(self, cfg, device: torch.device, init_state: dict, guard: bool,
                 compile: bool):
        from tqdm import tqdm

        from steadydiff.config import replace
        from steadydiff.trainer import loop, telemetry
        changes: dict[str, Any] = {"guard.enabled": guard}
        if compile and has_compile_key(cfg):
            changes["train.compile"] = True
        cfg = self.cfg = latent_cfg(replace(cfg, changes))
        self.loop, self.telemetry, self.name = loop, telemetry, "guard" if guard else "off"
        state = self.state = loop.build_state(cfg, cfg.model.num_classes, device)
        state.model.load_state_dict(init_state)
        state.ema.module.load_state_dict(init_state)
        self.compile_source: str | None = None
        if compile:
            if "train.compile" in changes:  # as loop.run sets it up (after any DDP wrap)
                from steadydiff.trainer.compilation import compile_forward
                compile_forward(state)
                self.compile_source = "train.compile"
            else:  # this version has no train.compile: the whole model, in place
                state.model.compile()
                self.compile_source = "bench"
        loop.attach_guard(state, None, defer=True)  # None when off; deferred, as loop.run runs it
        self.window: list = []
        self.tick = time.perf_counter()
        self.sink = open(os.devnull, "w")
        self.bar = tqdm(total=10**9, file=self.sink, dynamic_ncols=False, desc="train")


# --------------------------------------------------------------------------- one group


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(v, batches: list, pos: dict, n: int, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    v.run(batches, pos[v.name], n)
    _sync(device)
    pos[v.name] += n
    return time.perf_counter() - t0


def count_cuda_syncs(v, batches: list, pos: dict, n: int, device: torch.device) -> int:
    """Host syncs of ``n`` steps of ``v``: the warnings of sync-debug mode "warn" (one per
    synchronising call) plus the deliberate ``hostsync`` reads (exempt from the mode)."""
    from steadydiff import hostsync
    _sync(device)
    before, mode = hostsync.reads(), torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # not once per call site: every sync counts
        torch.cuda.set_sync_debug_mode("warn")
        try:
            v.run(batches, pos[v.name], n)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    _sync(device)
    pos[v.name] += n
    warned = sum("synchroniz" in str(w.message) for w in caught)
    return warned + hostsync.reads() - before


def sync_window(cfg, cap: int = 200) -> int:
    """Steps of the sync-counting run: a multiple of every periodic host-side event's period
    (the status tick, the guard's snapshots and, where the key exists, its checks), so that
    count / steps is their long-run average; the largest period when the multiple is over
    ``cap``."""
    periods = [cfg.logging.log_every, cfg.guard.snapshot_every,
               getattr(cfg.guard, "check_every", 1) or 1]
    n = math.lcm(*periods)
    return n if n <= cap else max(periods)


def bench_group(cfg, *, compile: bool, device: torch.device, batches: list, flops: int,
                peak: float | None, allot_s: float, steps: int, repeats: int,
                warmup: int, max_steps: int) -> dict[str, Any]:
    """Time bare, off and guard for one (model, precision, compile) of the validated config
    ``cfg``; ``steps`` 0 plans the steps per repeat so that the group takes about
    ``allot_s`` seconds."""
    from steadydiff import hostsync
    from steadydiff.models import build_model
    t_group = time.perf_counter()
    cuda = device.type == "cuda"
    if compile:
        torch._dynamo.reset()  # each group's graphs are its own (precision, model)
    torch.manual_seed(cfg.train.seed)
    init = build_model(cfg.model, image_size=cfg.data.image_size,
                       channels=LATENT_CHANNELS).state_dict()
    makers = [lambda: Bare(latent_cfg(cfg), device, init, compile),
              lambda: Trainer(cfg, device, init, guard=False, compile=compile),
              lambda: Trainer(cfg, device, init, guard=True, compile=compile)]
    vs, resident, pos, setup_s = [], {}, {}, {}
    for make in makers:  # build and warm up one at a time: its resident memory is its own
        _sync(device)
        t0 = time.perf_counter()
        a0 = torch.cuda.memory_allocated(device) if cuda else 0
        v = make()
        pos[v.name] = 0
        _timed(v, batches, pos, warmup, device)  # compile, allocator, guard's first snapshot
        resident[v.name] = (torch.cuda.memory_allocated(device) - a0) if cuda else None
        setup_s[v.name] = time.perf_counter() - t0
        vs.append(v)
    count_n = sync_window(cfg) if cuda else 0
    if not steps:  # fill the rest of the allotment: R timed runs + the counting run
        probe = {v.name: _timed(v, batches, pos, 2, device) / 2 for v in vs}
        left = allot_s - (time.perf_counter() - t_group)
        per_variant = left / sum(probe.values()) - count_n  # steps left for each variant
        steps = int(min(max_steps, max(10, per_variant / repeats)))
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    step_peak: dict[str, float] = {v.name: 0.0 for v in vs}
    reads = {v.name: 0 for v in vs}
    for _ in range(repeats):
        for v in vs:  # interleaved: bare, off, guard, bare, off, guard, ...
            if cuda:
                _sync(device)
                a0 = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            r0 = hostsync.reads()
            times[v.name].append(_timed(v, batches, pos, steps, device) / steps)
            reads[v.name] += hostsync.reads() - r0
            if cuda:
                step_peak[v.name] = max(step_peak[v.name],
                                        torch.cuda.max_memory_allocated(device) - a0)
    syncs = {v.name: count_cuda_syncs(v, batches, pos, count_n, device) / count_n
             for v in vs} if cuda else {}
    batch = cfg.train.batch_size
    base = statistics.median(times["bare"])
    rows = []
    for v in vs:
        sec = statistics.median(times[v.name])
        rows.append({
            "variant": v.name, "ms_per_step": sec * 1e3, "images_per_sec": batch / sec,
            "ratio_vs_bare": sec / base,
            "repeats_ms_per_step": [t * 1e3 for t in times[v.name]],
            "hostsync_reads_per_step": reads[v.name] / (steps * repeats),
            "cuda_syncs_per_step": syncs.get(v.name),
            "peak_mib": (resident[v.name] + step_peak[v.name]) / 2**20 if cuda else None,
            "resident_mib": resident[v.name] / 2**20 if cuda else None,
            "achieved_tflops": flops / sec / 1e12,
            "mfu": flops / sec / (peak * 1e12) if peak else None,
            "setup_s": setup_s[v.name], "compile_source": v.compile_source,
            "interventions": v.interventions,
        })
    out = {"steps_per_repeat": steps, "repeats": repeats, "warmup": warmup,
           "batch_size": batch, "flops_per_step": flops, "peak_tflops": peak,
           "log_every": cfg.logging.log_every, "sync_count_steps": count_n or None,
           "variants": rows,
           "seconds": time.perf_counter() - t_group}
    return out


# --------------------------------------------------------------------------- main


def _fmt(v: float | None, spec: str, na: str = "n/a") -> str:
    return na if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown_table(groups: list[dict[str, Any]]) -> str:
    head = ["variant", "model", "precision", "compile", "ms/step", "img/s", "syncs/step",
            "hostsync/step", "peak MiB", "TFLOP/s", "MFU", "vs bare"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        for r in g["variants"]:
            cells = [r["variant"], g["model"], g["precision"],
                     ("on" + (" (bench)" if r["compile_source"] == "bench" and
                              r["variant"] != "bare" else "")) if g["compile"] else "off",
                     f"{r['ms_per_step']:.2f}", f"{r['images_per_sec']:.1f}",
                     _fmt(r["cuda_syncs_per_step"], ".2f"),
                     f"{r['hostsync_reads_per_step']:.2f}", _fmt(r["peak_mib"], ".0f"),
                     f"{r['achieved_tflops']:.3g}", _fmt(r["mfu"], ".1%"),
                     f"{r['ratio_vs_bare']:.3f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cpu")
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                   help="tiny widths and sizes (default: on without CUDA)")
    p.add_argument("--models", default="unet,dit", help="comma list of unet, dit")
    p.add_argument("--precisions", default=None,
                   help="comma list of fp32, bf16, fp16 (default: bf16,fp16 on CUDA; fp32 on "
                        "a CPU, where bf16/fp16 autocast is emulated, 13-24x slower)")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off", "both"],
                   help="auto: both on CUDA, off on a CPU (building the graphs takes long)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"every model's batch (default: unet {MODELS['unet'][2]}, dit "
                        f"{MODELS['dit'][2]} on a GPU; {TINY_BATCH} tiny)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per repeat; 0: planned (at least 10, at most "
                        "--max-steps) to fit --budget-s (default: 0 on CUDA, 3 on a CPU)")
    p.add_argument("--max-steps", type=int, default=200, help="cap of the planned --steps")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per variant "
                   "(default 5 on CUDA, 2 on a CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per variant first (default 5 on CUDA, 1 on a CPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole run, seconds (default 280 on CUDA, "
                        "60 on a CPU); groups that would not fit are skipped and listed")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOPS for MFU (overrides the datasheet table)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (0 keeps torch's default)")
    p.add_argument("--json", action=argparse.BooleanOptionalAction, default=True,
                   help="end with one JSON line")
    a = p.parse_args(argv)
    t_start = time.perf_counter()

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available()
                          else "cpu" if a.device == "auto" else a.device)
    cuda = device.type == "cuda"
    tiny = (not cuda) if a.tiny is None else a.tiny
    precisions = (a.precisions or ("bf16,fp16" if cuda else "fp32")).split(",")
    compiles = {"auto": [False, True] if cuda else [False], "on": [True], "off": [False],
                "both": [False, True]}[a.compile]
    repeats = a.repeats or (5 if cuda else 2)
    warmup = a.warmup if a.warmup is not None else (5 if cuda else 1)
    steps = a.steps if a.steps is not None else (0 if cuda else 3)
    budget = a.budget_s or (280.0 if cuda else 60.0)
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    gpu_name = torch.cuda.get_device_name(device) if cuda else None
    if cuda:
        torch.backends.cudnn.benchmark = True  # as loop.configure_runtime does on CUDA
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # the grid, most asked-for first: eager before compiled, bf16 before fp16
    plan = [(m, pr, c) for pr in precisions for c in compiles for m in models]
    cfgs = {(m, pr): model_cfg(m, tiny=tiny, batch=a.batch_size, precision=pr, device=device)
            for m in models for pr in precisions}
    batches = {m: make_batches(cfgs[(m, precisions[0])], 4, device) for m in models}
    flops = {m: step_flops(latent_cfg(cfgs[(m, precisions[0])]), batches[m][0], device)
             for m in models}

    result: dict[str, Any] = {"bench": "gpu", "device": str(device), "gpu": gpu_name,
                              "tiny": tiny, "budget_s": budget,
                              "train_compile_key": has_compile_key(cfgs[plan[0][:2]]),
                              "flops_per_step": flops, "groups": [], "skipped": []}
    result.update(env_info())
    def weight(c: bool) -> float:  # a compiled group's share: twice, for building graphs
        return 2.0 if c else 1.0

    for k, (m, pr, c) in enumerate(plan):
        left = budget - (time.perf_counter() - t_start) - 5.0  # 5 s for the output
        done = result["groups"]
        # a group costs at least what the cheapest like it did (its compile, its warm-up)
        like = [g["seconds"] for g in done if g["compile"] == c] or [0.0]
        if left <= 0 or (done and left < 0.5 * min(like)):
            result["skipped"].append({"model": m, "precision": pr, "compile": c,
                                      "why": f"budget: {max(left, 0):.0f} s left of "
                                             f"{budget:.0f}"})
            continue
        peak = a.peak_tflops or peak_tflops(gpu_name, pr)
        try:
            g = bench_group(cfgs[(m, pr)], compile=c, device=device, batches=batches[m],
                            flops=flops[m], peak=peak,
                            allot_s=left * weight(c) / sum(weight(c2) for *_, c2 in plan[k:]),
                            steps=steps, repeats=repeats, warmup=warmup,
                            max_steps=a.max_steps)
        except torch.OutOfMemoryError as e:  # three models' state + one step's activations
            oom = str(e).splitlines()[0]
        else:
            oom = ""
        # the group's variants are gone (its frame; out of the except clause, the traceback
        # too): free their memory before the next group builds its own
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if oom:
            result["skipped"].append({"model": m, "precision": pr, "compile": c,
                                      "why": f"out of memory (try --batch-size): {oom}"})
            continue
        result["groups"].append({"model": m, "precision": pr, "compile": c, **g})
    result["elapsed_s"] = time.perf_counter() - t_start

    shape = f"{TINY_SIZE if tiny else SIZE}x{TINY_SIZE if tiny else SIZE}x{LATENT_CHANNELS}"
    print(f"GPU benchmark on {gpu_name or 'CPU: ' + result['machine']['cpu']}"
          f"{' (tiny models)' if tiny else ''}, latent {shape}, "
          f"{result['elapsed_s']:.0f} s of a {budget:.0f} s budget\n")
    print(markdown_table(result["groups"]))
    print("\nsyncs/step: CUDA sync-debug count incl. hostsync reads (n/a on a CPU); "
          "hostsync/step: steadydiff.hostsync reads; MFU: model fwd+bwd FLOPs / step time / "
          "peak" + ("" if cuda or a.peak_tflops else " (n/a: no peak for a CPU; "
                                                     "--peak-tflops)"))
    for g in result["groups"]:
        if any(r["interventions"] for r in g["variants"]):
            print(f"note ({g['model']} {g['precision']} compile={g['compile']}): steps not "
                  "applied: " + ", ".join(f"{r['variant']} {r['interventions']}"
                                           for r in g["variants"]))
    if not result["train_compile_key"] and any(c for *_, c in plan):
        print("note: this version has no train.compile; the steadydiff variants' model was "
              "compiled by the bench (model.compile())")
    for s in result["skipped"]:
        print(f"skipped: {s['model']} {s['precision']} compile={s['compile']} ({s['why']})")
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
