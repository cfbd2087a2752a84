"""Throughput: the trainer's full step against a bare PyTorch loop, the guard's overhead, and
sampling speed per sampler, on the quick-start model (configs/digits_cond.yaml).

Three training variants run side by side in one process, interleaved (bare, off, guard; off,
guard, bare; ...) so that load from other processes on the machine falls on all of them alike:

- ``bare``:  a plain PyTorch loop with the same model (same init), batches, objective and
  AdamW (same parameter groups and kernel, ``optim.fused``): forward, backward,
  ``clip_grad_norm_(1.0)``, ``opt.step()``,
  a fused EMA lerp, and a ``.item()`` of the mean loss at each logging tick.
- ``off``:   steadydiff's ``train_step`` with the guard disabled, plus what ``run`` does per
  step (the metrics row every ``logging.log_every`` steps, the progress bar).
- ``guard``: the same with the guard on, as the trainer runs it (the deferred check: one host
  read every ``guard.check_every`` steps and at each logging tick, weight check, snapshots
  every ``guard.snapshot_every`` steps).
- ``compile`` (opt-in: ``--variants bare,off,guard,compile``): ``guard`` with
  ``train.compile=true`` (torch.compile of the training forward, inductor, ``--compile-mode``).
  Its first step traces and builds the kernels: it is always an untimed step, and reported
  apart as ``first_step_sec`` and ``compile_sec`` (the first step less a median step).

Every variant draws from the same pre-loaded list of batches (taken from the trainer's own
loader), so data loading is excluded from all three; its cost per batch is reported apart.
Each repeat times ``--steps`` consecutive steps of one variant; the figure is the median of
``--repeats`` repeats after ``--warmup`` untimed steps. The order of the variants rotates
from one round of repeats to the next, and each repeat records both wall time and this
process's CPU time (``process_time``): on a shared machine other processes' load lengthens
the wall time of whichever variant runs while they do, not its CPU time.

Sampling speed: images/s for each sampler at its usual step count (ddpm 1000, ddim 50,
dpmpp_2m 20, euler 50), on the quick-start model with the quick-start ``sample`` settings
(classifier-free guidance at scale 2.0 doubles every model batch). Weights do not change the
speed, so a freshly initialised model is used unless ``--checkpoint`` is given.

Probe cost (``--probe-repeats N``): one attention/normalization health probe (the guard's
``probes.probe`` over the trainer's own probe forward: micro-batch 0 of the step, no grad,
attention written out in fp32) against one guarded training step, interleaved step, probe,
step, probe, ...; the median of each and the per-step overhead at a few cadences
(``guard.probe_every``).

    python bench/throughput.py                    # full run (~6 minutes on 2 cores)
    python bench/throughput.py --variants '' --samplers '' --probe-repeats 20   # probe only
    python bench/throughput.py --steps 2 --repeats 1 --warmup 1 --sample-steps-scale 0.02 --json
    python bench/throughput.py --variants bare,off,guard,compile --samplers '' --json   # compile
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: one busy thread each

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "digits_cond.yaml"

# sampler -> steps (model evaluations), as the benchmark reports them
SAMPLER_STEPS = {"ddpm": 1000, "ddim": 50, "dpmpp_2m": 20, "euler": 50}


# --------------------------------------------------------------------------- shared helpers
# (bench/samplers.py and bench/stability.py import these)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def env_info() -> dict[str, Any]:
    """The machine and the versions, for the JSON line every bench script ends with."""
    import steadydiff
    return {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else None},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "steadydiff": steadydiff.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }


def print_table(rows: list[list[Any]], header: list[str]) -> None:
    """A plain left-aligned text table."""
    cells = [[str(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for k, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))


def load_cfg(path: str | Path, overrides: list[str]):
    from steadydiff.config import load_config
    return load_config(path, overrides)


# --------------------------------------------------------------------------- training variants


class Variant:
    """One training loop, advanced ``n`` steps at a time over a shared list of batches."""

    name: str
    # strict: a step the guard did not apply is an error (a clean fp32 run has none);
    # otherwise it is counted (bench/gpu.py: fp16's scaler skips while its scale calibrates)
    strict = True
    interventions = 0

    def run(self, batches: list, start: int, n: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class TrainerVariant(Variant):
    """steadydiff's ``train_step`` plus the per-step bookkeeping of ``loop.run``."""

    def __init__(self, cfg, device: torch.device, init_state: dict, guard: bool,
                 compile_mode: str | None = None):
        from tqdm import tqdm

        from steadydiff.config import replace
        from steadydiff.trainer import loop
        from steadydiff.trainer.compilation import compile_forward
        self.loop = loop
        self.name = "compile" if compile_mode else "guard" if guard else "off"
        overrides: dict[str, Any] = {"guard.enabled": guard}
        if compile_mode:  # train.compile, as loop.run sets it up (after any DDP wrap)
            overrides.update({"train.compile": True, "train.compile_mode": compile_mode})
        cfg = self.cfg = replace(cfg, overrides)
        self.state = loop.build_state(cfg, cfg.model.num_classes, device)
        self.state.model.load_state_dict(init_state)
        self.state.ema.module.load_state_dict(init_state)
        compile_forward(self.state)  # sets nothing without train.compile
        # None when the guard is off; deferred (guard.check_every), as the trainer runs it
        loop.attach_guard(self.state, None, defer=True)
        self.window: list = []
        self.tick = time.perf_counter()
        self.sink = open(os.devnull, "w")
        self.bar = tqdm(total=10**9, file=self.sink, dynamic_ncols=False, desc="train")
        from steadydiff.trainer import telemetry
        self.telemetry = telemetry

    def _intervened(self, what: str) -> None:
        if self.strict:
            raise RuntimeError(f"guard intervened in the clean benchmark: {what}")
        self.interventions += 1

    def run(self, batches: list, start: int, n: int) -> None:
        # mirrors the body of loop.run's while-loop (the guard's deferred check, metrics row,
        # layer statistics, bar)
        loop, state, log_every = self.loop, self.state, self.cfg.logging.log_every
        for i in range(start, start + n):
            out = loop.train_step(state, batches[i % len(batches)])
            d = out.decision
            if loop.handle_decision(state, d) != "stepped":
                self._intervened(f"{d.action} ({d.incident.kind if d.incident else ''})")
                continue
            self.window.append(out)
            self.bar.update(1)
            g = state.guard
            if g is not None and g.pending and (g.due() or state.step % log_every == 0
                                                or out.layer_grad_norms is not None):
                # the window's speculative steps judged before anything reads the state
                # (loop.run does it at the top of its next pass: the same point)
                flushed = g.flush()
                if flushed.rewind is not None:  # a step failed: the loop would redo them
                    self._intervened(f"rewind ({flushed.rewind.why})")
                    self.window = [o for o in self.window if o.decision.step <= state.step]
                    continue
                loop.fill_verified(self.window, flushed.values)
                if state.weights.reads_at(state.step):
                    state.weights.after_update(state)  # an adapter's |dW|/|W| clamp
            if out.layer_grad_norms is not None:
                self.sink.write(json.dumps(self.telemetry.layer_stats(state, out)) + "\n")
            if state.step % log_every == 0:  # the trainer's status tick (host sync off-guard)
                now = time.perf_counter()
                row = self.telemetry.metrics_row(state, self.window,
                                                 (now - self.tick) / len(self.window), 0)
                self.sink.write(json.dumps(row) + "\n")
                self.bar.set_postfix_str(loop._status(row), refresh=False)
                self.tick, self.window = now, []


class BareVariant(Variant):
    """What a careful hand-written PyTorch loop does, nothing more."""

    name = "bare"

    def __init__(self, cfg, device: torch.device, init_state: dict):
        from steadydiff.diffusion import make_schedule
        from steadydiff.models import build_model
        from steadydiff.trainer.optim import lr_at, param_groups
        from steadydiff.trainer.speed import optimizer_kwargs
        self.cfg, self.device, self.lr_at = cfg, device, lr_at
        self.model = build_model(cfg.model, image_size=cfg.data.image_size,
                                 channels=cfg.data.channels).to(device)
        self.model.load_state_dict(init_state)
        self.ema = copy.deepcopy(self.model).eval().requires_grad_(False)
        # the trainer's kernel (optim.fused): the comparison is of the loops, not of AdamWs
        self.opt = torch.optim.AdamW(param_groups(self.model, cfg.optim), lr=cfg.optim.lr,
                                     betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                     **optimizer_kwargs(cfg.optim.fused, device))
        self.params = list(self.model.parameters())
        self.ema_params = list(self.ema.parameters())
        self.schedule = make_schedule(cfg.diffusion)
        self.gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
        self.step = 0
        self.losses: list[torch.Tensor] = []
        self.last_loss = float("nan")

    def run(self, batches: list, start: int, n: int) -> None:
        cfg, opt = self.cfg, self.opt
        for i in range(start, start + n):
            batch = batches[i % len(batches)]
            x, y = batch[0].to(self.device), batch[1].to(self.device)
            lr = self.lr_at(self.step, cfg.optim, cfg.train.steps)
            for g in opt.param_groups:
                g["lr"] = lr
            loss = self.forward(x, y)
            self.update(loss)
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                d = min(cfg.train.ema_decay, (1 + self.step) / (10 + self.step))
                torch._foreach_lerp_(self.ema_params, self.params, 1.0 - d)
            self.losses.append(loss.detach())
            self.step += 1
            if self.step % cfg.logging.log_every == 0:
                self.last_loss = torch.stack(self.losses).mean().item()  # host sync
                self.losses = []

    def forward(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """The loss of one batch (bench/gpu.py adds autocast)."""
        from steadydiff.diffusion import diffusion_loss
        return diffusion_loss(self.model, x, y, self.schedule, self.cfg.diffusion,
                              self.gen).loss

    def update(self, loss: torch.Tensor) -> None:
        """Backward, clip, optimizer step (bench/gpu.py adds the fp16 grad scaler)."""
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        self.opt.step()


def bench_training(cfg, *, steps: int, repeats: int, warmup: int, variants: list[str],
                   num_batches: int, device: torch.device,
                   compile_mode: str = "default") -> dict[str, Any]:
    """Median sec/step of each variant, measured interleaved; the first (untimed) step of
    each on its own, which for ``compile`` holds the compilation."""
    from steadydiff.data import build_dataset, make_loader
    from steadydiff.models import build_model

    data = build_dataset(cfg.data)
    loader = iter(make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                              hflip=cfg.data.hflip))
    t0 = time.perf_counter()
    batches = [next(loader) for _ in range(num_batches)]
    load_s = (time.perf_counter() - t0) / num_batches

    torch.manual_seed(cfg.train.seed)
    init = build_model(cfg.model, image_size=cfg.data.image_size,
                       channels=cfg.data.channels).state_dict()
    make: dict[str, Callable[[], Variant]] = {
        "bare": lambda: BareVariant(cfg, device, init),
        "off": lambda: TrainerVariant(cfg, device, init, guard=False),
        "guard": lambda: TrainerVariant(cfg, device, init, guard=True),
        "compile": lambda: TrainerVariant(cfg, device, init, guard=True,
                                          compile_mode=compile_mode),
    }
    vs = [make[v]() for v in variants]
    pos = {v.name: 0 for v in vs}
    first: dict[str, float] = {}
    for v in vs:  # warm-up: allocator, kernels, first snapshots, guard detector warm-up
        n = max(warmup, 1) if v.name == "compile" else warmup  # never time the compile
        if n:
            t0 = time.perf_counter()
            v.run(batches, 0, 1)  # the first step: for compile, tracing and kernel builds
            first[v.name] = time.perf_counter() - t0
            v.run(batches, 1, n - 1)
        pos[v.name] = n
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    cpu: dict[str, list[float]] = {v.name: [] for v in vs}
    for r in range(repeats):
        # interleaved, the order rotated each round (bare, off, guard; off, guard, bare; ...):
        # no variant always runs first, or always right after another one
        for v in vs[r % len(vs):] + vs[:r % len(vs)]:
            c0, t0 = time.process_time(), time.perf_counter()
            v.run(batches, pos[v.name], steps)
            times[v.name].append((time.perf_counter() - t0) / steps)
            cpu[v.name].append((time.process_time() - c0) / steps)
            pos[v.name] += steps
    med = {k: statistics.median(t) for k, t in times.items()}
    out: dict[str, Any] = {"sec_per_step": med, "repeats_sec_per_step": times,
                           "mean_sec_per_step": {k: statistics.fmean(t) for k, t in times.items()},
                           # this process's CPU time: what other processes' load on the
                           # machine does not add to (wall time waits while they run)
                           "cpu_sec_per_step": {k: statistics.median(t) for k, t in cpu.items()},
                           "repeats_cpu_sec_per_step": cpu,
                           "data_loading_sec_per_batch": load_s,
                           "first_step_sec": first,
                           "steps_per_repeat": steps, "repeats": repeats, "warmup": warmup,
                           "batch_size": cfg.train.batch_size}
    if "compile" in med:
        out["compile_mode"] = compile_mode
        out["compile_sec"] = first["compile"] - med["compile"]
    if "guard" in med and "compile" in med:
        out["speedup_compile_vs_guard"] = med["guard"] / med["compile"]
        out["speedup_compile_vs_guard_paired_median"] = statistics.median(
            g / c for g, c in zip(times["guard"], times["compile"]))
    if "bare" in med and "guard" in med:
        out["ratio_guard_vs_bare"] = med["guard"] / med["bare"]
    if "bare" in med and "off" in med:
        out["ratio_off_vs_bare"] = med["off"] / med["bare"]
    if "off" in med and "guard" in med:
        out["guard_overhead"] = med["guard"] / med["off"] - 1.0
        # per-repeat paired ratios (neighbours in time): a second view robust to load drift
        out["guard_overhead_paired_median"] = statistics.median(
            g / o for g, o in zip(times["guard"], times["off"])) - 1.0
    if "bare" in med and "guard" in med:
        out["ratio_guard_vs_bare_paired_median"] = statistics.median(
            g / b for g, b in zip(times["guard"], times["bare"]))
        out["ratio_guard_vs_bare_cpu"] = (out["cpu_sec_per_step"]["guard"]
                                          / out["cpu_sec_per_step"]["bare"])
        out["ratio_guard_vs_bare_cpu_paired_median"] = statistics.median(
            g / b for g, b in zip(cpu["guard"], cpu["bare"]))
    if "bare" in med and "off" in med:
        out["ratio_off_vs_bare_cpu"] = (out["cpu_sec_per_step"]["off"]
                                        / out["cpu_sec_per_step"]["bare"])
    return out


# --------------------------------------------------------------------------- probe cost


def bench_probe(cfg, *, repeats: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """Median seconds of one health probe and of one guarded training step, interleaved."""
    from steadydiff.config import replace
    from steadydiff.data import build_dataset, make_loader
    from steadydiff.guard import probes
    from steadydiff.trainer import loop

    # the probe forward is exposed on layer-statistics steps: make every step one; the
    # guard's own schedule is off so that only the timed probe runs
    cfg = replace(cfg, {"logging.layer_stats_every": 1, "guard.probe_every": 0})
    data = build_dataset(cfg.data)
    loader = iter(make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed))
    torch.manual_seed(cfg.train.seed)
    state = loop.build_state(cfg, cfg.model.num_classes, device)
    loop.attach_guard(state, None)
    step_s, probe_s = [], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = loop.train_step(state, next(loader))
        loop.handle_decision(state, out.decision, say=lambda _m: None)
        t1 = time.perf_counter()
        stats = probes.probe(state.model, out.probe_forward)
        t2 = time.perf_counter()
        if i >= warmup:
            step_s.append(t1 - t0)
            probe_s.append(t2 - t1)
    step, probe = statistics.median(step_s), statistics.median(probe_s)
    attn = stats["attn"].values()
    return {"sec_per_step": step, "sec_per_probe": probe, "probe_vs_step": probe / step,
            "overhead_at_every": {n: probe / (n * step) for n in (1, 10, 50, 100, 250)},
            "repeats": repeats, "warmup": warmup, "attention_layers": len(stats["attn"]),
            "last_max_logit": max((a["max_logit"] for a in attn), default=None),
            "last_min_entropy": min((a["entropy"] for a in attn), default=None)}


# --------------------------------------------------------------------------- sampling


def bench_sampling(cfg, *, samplers: dict[str, int], num: int, repeats: int,
                   device: torch.device, checkpoint: str | None) -> dict[str, Any]:
    """Images/s of each sampler (median of ``repeats`` after one short warm-up call)."""
    from steadydiff import seeding
    from steadydiff.diffusion import make_schedule, sample
    from steadydiff.models import build_model

    if checkpoint:
        from steadydiff import load
        pipe = load(checkpoint, device=device)
        model, schedule, cfg = pipe.model, pipe.schedule, pipe.config
    else:
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, image_size=cfg.data.image_size,
                            channels=cfg.data.channels).to(device).eval().requires_grad_(False)
        schedule = make_schedule(cfg.diffusion)
    s = cfg.sample
    shape = (num, model.in_channels, model.image_size, model.image_size)
    y = torch.arange(num, device=device) % model.num_classes if model.num_classes else None

    def once(name: str, steps: int) -> float:
        gen = seeding.generator(device, s.seed)
        t0 = time.perf_counter()
        sample(model, schedule, cfg.diffusion.prediction, shape, sampler=name, steps=steps,
               y=y, cfg_scale=s.cfg_scale, eta=s.eta, generator=gen, device=device)
        return time.perf_counter() - t0

    once("dpmpp_2m", 2)  # warm-up
    res: dict[str, Any] = {}
    times: dict[str, list[float]] = {k: [] for k in samplers}
    for _ in range(repeats):
        for name, steps in samplers.items():  # interleaved across samplers
            times[name].append(once(name, steps))
    for name, steps in samplers.items():
        sec = statistics.median(times[name])
        res[name] = {"steps": steps, "num": num, "seconds": sec, "images_per_sec": num / sec,
                     "sec_per_model_eval": sec / steps, "cfg_scale": s.cfg_scale,
                     "model_batch": num * (2 if y is not None and s.cfg_scale != 1 else 1)}
    return res


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="training config")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides, as `steadydiff train --set`")
    p.add_argument("--steps", type=int, default=25,
                   help="timed steps per repeat (25 = one logging interval)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per variant")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first")
    p.add_argument("--variants", default="bare,off,guard",
                   help="comma list of bare, off (guard off), guard (guard on), compile "
                        "(guard on, train.compile=true)")
    p.add_argument("--compile-mode", default="default",
                   help="train.compile_mode of the compile variant")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the machine is shared; 0 keeps torch's default)")
    p.add_argument("--samplers", default=",".join(SAMPLER_STEPS),
                   help="comma list of samplers to time ('' skips sampling)")
    p.add_argument("--sample-num", type=int, default=100,
                   help="images per sampling call (quick-start grid size)")
    p.add_argument("--sample-repeats", type=int, default=3)
    p.add_argument("--sample-steps-scale", type=float, default=1.0,
                   help="multiply every sampler's step count (smoke tests)")
    p.add_argument("--checkpoint", default=None,
                   help="sample from this checkpoint/run dir instead of a fresh model")
    p.add_argument("--probe-repeats", type=int, default=0,
                   help="time one health probe against one training step this many times "
                        "(0 skips it)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    a = p.parse_args(argv)

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cfg = load_cfg(a.config, a.set)
    variants = [v for v in a.variants.split(",") if v]
    result: dict[str, Any] = {"bench": "throughput", "config": str(a.config),
                              "overrides": a.set}
    result.update(env_info())

    if variants:
        num_batches = max(8, min(64, a.warmup + a.steps * a.repeats))
        tr = bench_training(cfg, steps=a.steps, repeats=a.repeats, warmup=a.warmup,
                            variants=variants, num_batches=num_batches, device=device,
                            compile_mode=a.compile_mode)
        result["training"] = tr
        med = tr["sec_per_step"]
        print(f"training step, {cfg.train.batch_size} images of "
              f"{cfg.data.image_size}x{cfg.data.image_size}, median of {a.repeats} x "
              f"{a.steps} steps, torch threads {torch.get_num_threads()}:")
        base = med.get("bare")
        cpu, cbase = tr["cpu_sec_per_step"], tr["cpu_sec_per_step"].get("bare")
        print_table([[k, f"{v * 1000:.1f}", f"{v / base:.3f}x" if base else "-",
                      f"{cpu[k] * 1000:.1f}", f"{cpu[k] / cbase:.3f}x" if cbase else "-"]
                     for k, v in med.items()],
                    ["variant", "ms/step", "vs bare", "CPU ms/step", "vs bare (CPU)"])
        if "ratio_guard_vs_bare" in tr:
            print(f"trainer (guard on) vs bare loop: {tr['ratio_guard_vs_bare']:.3f}x "
                  f"(paired median {tr['ratio_guard_vs_bare_paired_median']:.3f}x; CPU time "
                  f"{tr['ratio_guard_vs_bare_cpu']:.3f}x, paired "
                  f"{tr['ratio_guard_vs_bare_cpu_paired_median']:.3f}x; aim <= 1.03x)")
        if "guard_overhead" in tr:
            print(f"guard overhead (on vs off): {tr['guard_overhead']:+.1%} "
                  f"(paired median {tr['guard_overhead_paired_median']:+.1%}; aim <= 3%)")
        if "compile_sec" in tr:
            vs = (f" vs guard on: {tr['speedup_compile_vs_guard']:.3f}x faster per step (paired "
                  f"median {tr['speedup_compile_vs_guard_paired_median']:.3f}x)"
                  if "speedup_compile_vs_guard" in tr else "")
            print(f"compile (guard on, train.compile=true, mode {tr['compile_mode']}){vs}; "
                  f"its first step took {tr['first_step_sec']['compile']:.1f} s (compile "
                  f"~{tr['compile_sec']:.1f} s, excluded above)")
        print(f"data loading (excluded above): {tr['data_loading_sec_per_batch'] * 1000:.1f} "
              "ms/batch")

    if a.probe_repeats:
        pr = bench_probe(cfg, repeats=a.probe_repeats, warmup=a.warmup, device=device)
        result["probe"] = pr
        print(f"\nhealth probe ({pr['attention_layers']} attention layers) vs one guarded "
              f"training step, median of {pr['repeats']}: probe "
              f"{pr['sec_per_probe'] * 1000:.1f} ms, step {pr['sec_per_step'] * 1000:.1f} ms "
              f"({pr['probe_vs_step']:.1%} of a step)")
        print("per-step overhead at guard.probe_every = " + ", ".join(
            f"{n}: {v:.2%}" for n, v in pr["overhead_at_every"].items()))

    samplers = {s: max(1, round(SAMPLER_STEPS[s] * a.sample_steps_scale))
                for s in a.samplers.split(",") if s}
    if samplers:
        sp = bench_sampling(cfg, samplers=samplers, num=a.sample_num, repeats=a.sample_repeats,
                            device=device, checkpoint=a.checkpoint)
        result["sampling"] = sp
        print(f"\nsampling {a.sample_num} images (cfg scale {cfg.sample.cfg_scale}: model batch "
              f"{next(iter(sp.values()))['model_batch']}), median of {a.sample_repeats}:")
        print_table([[k, v["steps"], f"{v['seconds']:.2f}", f"{v['images_per_sec']:.1f}",
                      f"{v['sec_per_model_eval'] * 1000:.1f}"] for k, v in sp.items()],
                    ["sampler", "steps", "seconds", "images/s", "ms/model eval"])
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
