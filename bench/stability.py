"""Stability: each injected fault run three ways (issue 3's table), and the diagnosis
scenarios of issue 13 (the guard alone).

For every scenario (clean, nan_batch, outlier_batch, loss_scale, lr_scale, param_nan,
param_huge, grad_nan, fp16_overflow, attn_logit_overflow, oom) the quick-start digits config is trained three ways:

- ``guard``: steadydiff's trainer (``loop.run``) with ``guard.enabled=true``;
- ``off``:   the same trainer with ``guard.enabled=false``;
- ``bare``:  a plain PyTorch loop written below (same model init, data order, objective,
  AdamW parameter groups, LR schedule, clip at 1.0, EMA), with the fault injected by the same
  :class:`FaultInjector` hooks at the same step and the same places in the step.

Reported per (scenario, mode): finished (no exception, no abort), finite (no non-finite value
in the weights or the EMA), ``eval_loss_ratio`` (the final EMA model's loss on a fixed
evaluation batch, fixed data, t and noise, divided by the clean run's of the same mode),
incidents (count, kinds, actions, from ``incidents.jsonl``), recovery cost (steps redone,
batches skipped, skipped steps) and ``diagnosis_ok``: the guard's incident kind is the one
expected for the injected fault (table ``SCENARIOS``) and, for parameter/activation faults,
the parameter/module it names is the injected one (``FaultInjector.fired``).

The diagnosis scenarios (``DIAGNOSIS``: a recurring bad sample, an LR ramp, a weight
corrupted between steps, a bad sample in one micro-batch of four, fp16 overflow in an
attention layer) ask more of the diagnosis: the named cause must be the injected one down to
the sample (index and micro-batch, and its quarantine), the LR (``lr_too_high`` with the LR
values and a cap), the parameter or the module; their cost counts samples dropped as well.

    python bench/stability.py --scenarios diagnosis --modes guard   # issue 13's table
    python bench/stability.py --outside --steps 120   # issue 27: outside faults, K=1 vs 10

fp16: the ``fp16_overflow`` and ``attn_logit_overflow`` scenarios need fp16 autocast with a
GradScaler to mean anything, and fp16 autocast on a CPU without native fp16 is emulated
(convolution backward measured ~100 ms per call at a batch of 4: ~150x slower than fp32 at
the quick-start batch of 64). So on a CPU they run on the quick-start model with
``--fp16-batch`` (4) images for
``--fp16-steps`` (8) steps, against a ``clean_fp16`` reference of the same shape. On CUDA it
runs with the main settings.

    python bench/stability.py --jobs 2                  # the full table (~35 min on 2 cores)
    python bench/stability.py --scenarios clean,nan_batch --steps 20 --json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import copy
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import DEFAULT_CONFIG, REPO, env_info, print_table  # noqa: E402

MODES = ("guard", "off", "bare")

# scenario -> (fault dict without "step", or None; expected guard incident kinds;
#              what the diagnosis must also name: "param", "module" or None)
SCENARIOS: dict[str, tuple[dict | None, tuple[str, ...], str | None]] = {
    "clean": (None, (), None),
    "nan_batch": ({"kind": "nan_batch"}, ("bad_batch",), None),
    "outlier_batch": ({"kind": "outlier_batch", "factor": 1e4}, ("bad_batch",), None),
    "loss_scale": ({"kind": "loss_scale", "factor": 1e8}, ("loss_spike",), None),
    # lr_spike: the guard's pre-update LR check (since b4a25bc); weight_jump before it
    "lr_scale": ({"kind": "lr_scale", "factor": 1e3, "steps": 5}, ("lr_spike", "weight_jump"),
                 None),
    "param_nan": ({"kind": "param_nan"}, ("nonfinite_params",), "param"),
    "param_huge": ({"kind": "param_huge", "factor": 1e4}, ("weight_jump",), "param"),
    "grad_nan": ({"kind": "grad_nan"}, ("nonfinite_grad",), "param"),
    "clean_fp16": (None, (), None),
    # the default target is the middle attention block: the guard upcasts its attention first
    "fp16_overflow": ({"kind": "fp16_overflow", "factor": 1e4},
                      ("fp16_overflow", "attention_upcast"), "module"),
    "attn_logit_overflow": ({"kind": "attn_logit_overflow"}, ("attention_upcast",), "module"),
    "oom": ({"kind": "oom", "factor": 32}, ("out_of_memory",), None),
    # ---- issue 13: the diagnosis must name the injected cause itself
    # a sample corrupt every time it is drawn (from step 0: it recurs every epoch)
    "recurring_bad_sample": ({"kind": "bad_sample", "index": 7}, ("bad_batch",), "sample"),
    # an LR growing 5% per step from the fault step on (a scheduler bug)
    "lr_ramp": ({"kind": "lr_ramp", "factor": 1.05, "steps": 10**6}, ("lr_too_high",), "lr"),
    # one element of a weight becomes 1e36 between two steps
    "weight_corrupt": ({"kind": "weight_corrupt"}, ("weight_jump", "nonfinite_params"),
                       "param"),
    # gradient accumulation over 4 micro-batches, one sample of one of them corrupt
    "bad_micro_batch": ({"kind": "bad_sample", "index": 11}, ("bad_batch",), "micro_batch"),
}
FP16 = ("clean_fp16", "fp16_overflow", "attn_logit_overflow")
DIAGNOSIS = ("recurring_bad_sample", "lr_ramp", "weight_corrupt", "bad_micro_batch",
             "attn_logit_overflow")
FROM_START = ("recurring_bad_sample", "bad_micro_batch")  # the fault is on from step 0
EXTRA_SETS = {"bad_micro_batch": ["train.grad_accum=4"]}
DEFAULT_SCENARIOS = [s for s in SCENARIOS if s not in DIAGNOSIS or s == "attn_logit_overflow"]


# --------------------------------------------------------------------------- settings


def case_settings(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """Steps, fault step, batch and precision of one scenario."""
    fp16 = name in FP16
    small = fp16 and a.device != "cuda"
    steps = a.fp16_steps if small else a.steps
    fault_step = steps // 2 if small or a.fault_step is None else a.fault_step
    return {"steps": steps, "fault_step": 0 if name in FROM_START else fault_step,
            "batch_size": a.fp16_batch if small else None,
            "precision": "fp16" if fp16 else "fp32"}


def make_config(name: str, mode: str, a: argparse.Namespace):
    from steadydiff.config import load_config, replace
    s = case_settings(name, a)
    sets = [f"train.steps={s['steps']}", "train.sample_every=0", "train.checkpoint_every=0",
            f"guard.snapshot_every={a.snapshot_every}", "logging.progress=false",
            f"train.num_threads={a.threads}", f"train.device={a.device}",
            "sample.num=10", "sample.steps=5",  # the run's final grid: cheap
            f"guard.enabled={'true' if mode == 'guard' else 'false'}",
            f"train.precision={s['precision']}"]
    if s["precision"] != "fp32":
        sets.append("train.allow_slow_precision=true")
    if s["batch_size"]:
        sets.append(f"train.batch_size={s['batch_size']}")
    sets += EXTRA_SETS.get(name, []) + a.set
    cfg = load_config(a.config, sets)
    changes: dict[str, Any] = {}
    if "report" in type(cfg.logging).model_fields:
        changes["logging.report"] = False  # the HTML report is not what is measured
    fault = SCENARIOS[name][0]
    if fault is not None:
        changes["faults"] = [{**fault, "step": s["fault_step"]}]
    return replace(cfg, changes), s


# --------------------------------------------------------------------------- measurement


def eval_batch(cfg, n: int = 256, seed: int = 1234) -> dict[str, torch.Tensor]:
    """A fixed evaluation batch: n digits (every k-th image), t spread evenly over [0, T),
    noise from a fixed generator. The same for every scenario and mode."""
    from steadydiff.data import build_dataset
    data = build_dataset(cfg.data)
    idx = torch.linspace(0, len(data) - 1, n).long().tolist()
    items = [data[i] for i in idx]
    x0 = torch.stack([it[0] for it in items])
    y = torch.stack([torch.as_tensor(it[1]) for it in items]).long()
    T = cfg.diffusion.timesteps
    t = (torch.arange(n) * T // n).long()
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(x0.shape, generator=g)
    return {"x0": x0, "y": y, "t": t, "noise": noise}


@torch.no_grad()
def eval_loss(model: torch.nn.Module, cfg, batch: dict[str, torch.Tensor]) -> float:
    """The training objective (prediction target, loss weighting) on the fixed batch, with
    no label dropout, in fp32."""
    from steadydiff.diffusion import make_schedule
    from steadydiff.diffusion.objectives import loss_weights, q_sample, training_target
    dev = next(model.parameters()).device
    sch = make_schedule(cfg.diffusion)
    x0, noise, t = batch["x0"].to(dev), batch["noise"].to(dev), batch["t"].to(dev)
    y = batch["y"].to(dev) if getattr(model, "num_classes", 0) else None
    alpha, sigma = sch.alpha_sigma(t)
    out = model.eval()(q_sample(x0, alpha, sigma, noise), t.float(), y).float()
    err = (out - training_target(cfg.diffusion.prediction, x0, noise, alpha, sigma)).square()
    per = err.mean(dim=(1, 2, 3))
    if cfg.diffusion.loss_weighting != "uniform":
        per = per * loss_weights(cfg.diffusion, sch.snr(t))
    return float(per.mean())


def nonfinite(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


# --------------------------------------------------------------------------- steadydiff modes


def run_trainer(cfg, run_dir: Path, log) -> dict[str, Any]:
    """``loop.run`` as the CLI calls it; the TrainState is captured by wrapping
    ``build_state`` (RunResult does not expose the model, EMA or fault record)."""
    from steadydiff.trainer import loop
    captured: dict[str, Any] = {}
    orig = loop.build_state

    def capture(*args, **kw):
        captured["state"] = st = orig(*args, **kw)
        return st

    out: dict[str, Any] = {"finished": False, "error": None}
    loop.build_state = capture
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            res = loop.run(cfg, run_dir=run_dir, resume=False)
        out.update(finished=True, steps=res.steps)
    except Exception as e:  # GuardAbort, SimulatedOOM, anything: the run did not finish
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(traceback.format_exc(), file=log)
    finally:
        loop.build_state = orig
    st = captured.get("state")
    out["state_step"] = st.step if st else None
    out["model"] = st.model if st else None
    out["ema"] = st.ema.module if st else None
    out["fired"] = list(getattr(st.faults, "fired", [])) if st else []
    g = st.guard if st else None
    if g is not None:
        out["cost"] = {"steps_redone": g.counts["steps_redone"],
                       "batches_skipped": g.counts["batches_skipped"],
                       "skipped_steps": g.counts["skips"], "rollbacks": g.counts["rollbacks"],
                       "fp16_overflow_skips": g.scaler_skips,
                       "samples_dropped": g.counts.get("samples_dropped", 0),
                       "quarantined": sorted(getattr(g, "quarantine", ())),
                       "lr_cap": getattr(g, "lr_cap", None)}
        out["precision_end"] = st.precision
        out["micro_batch_end"] = -(-cfg.train.batch_size // st.grad_accum)
    return out


# --------------------------------------------------------------------------- the bare loop


def run_bare(cfg, log) -> dict[str, Any]:
    """A plain PyTorch training loop, as people write it, with the same faults injected by
    the same hooks. No checks of any kind: what it computes, it applies."""
    from steadydiff import seeding
    from steadydiff.data import build_dataset, make_loader
    from steadydiff.diffusion import diffusion_loss, make_schedule
    from steadydiff.guard.faults import FaultInjector
    from steadydiff.models import build_model
    from steadydiff.trainer.optim import lr_at, param_groups

    device = torch.device(cfg.train.device if cfg.train.device != "auto" else "cpu")
    seeding.seed_everything(cfg.train.seed)  # as the trainer does: the same initial weights
    model = build_model(cfg.model, image_size=cfg.data.image_size,
                        channels=cfg.data.channels).to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    opt = torch.optim.AdamW(param_groups(model, cfg.optim), lr=cfg.optim.lr,
                            betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    fp16 = cfg.train.precision == "fp16"
    scaler = torch.amp.GradScaler(device.type) if fp16 else None
    schedule = make_schedule(cfg.diffusion)
    data = build_dataset(cfg.data)
    batches = iter(make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                               hflip=cfg.data.hflip))
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    inj = FaultInjector(cfg.faults)
    out: dict[str, Any] = {"finished": False, "error": None, "model": model, "ema": ema}
    step = 0
    try:
        for step in range(cfg.train.steps):
            batch = next(batches)
            x, y = batch[0].to(device), batch[1].to(device)
            lr = lr_at(step, cfg.optim, cfg.train.steps)
            x, lr = inj.batch(step, x), inj.lr(step, lr)
            for g in opt.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)
            inj.micro_batch(step, x.shape[0])  # the simulated OOM: an exception, as on CUDA
            with torch.autocast(device.type, dtype=torch.float16, enabled=fp16), \
                    inj.forward(step, model):
                loss = diffusion_loss(model, x, y, schedule, cfg.diffusion, gen).loss
            loss = inj.loss(step, loss)
            (scaler.scale(loss) if scaler else loss).backward()
            inj.grads(step, model)
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            inj.params(step, model)
            inj.end_step(step)
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                d = min(cfg.train.ema_decay, (1 + step) / (10 + step))
                torch._foreach_lerp_(ema_params, params, 1.0 - d)
            if (step + 1) % cfg.logging.log_every == 0:
                print(f"step {step + 1} loss {loss.item():.4g}", file=log)
        out.update(finished=True, steps=cfg.train.steps)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(traceback.format_exc(), file=log)
    out["state_step"] = step + 1 if out["finished"] else step  # steps completed / failing step
    out["fired"] = list(inj.fired)
    return out


# --------------------------------------------------------------------------- judging


def read_incidents(run_dir: Path) -> list[dict]:
    p = run_dir / "incidents.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def named_by(inc: dict, what: str) -> list[str]:
    """The parameter or module names an incident row points at."""
    e = inc.get("evidence") or {}
    prov = e.get("provenance") or {}
    if what == "module":
        return [m for m in (prov.get("first_overflow_module"),
                            prov.get("first_nonfinite_module"), e.get("module")) if m]
    names = list(e.get("params") or [])
    names += list(prov.get("nonfinite_grad_params") or [])
    names += [r.get("param") for r in e.get("weight_growth_since_snapshot") or []]
    return [n for n in names if n]


def diagnose(name: str, incidents: list[dict], fired: list[dict]) -> tuple[bool, str]:
    """Did the guard name the injected kind (and parameter/module)? Returns (ok, why)."""
    _, expected, target = SCENARIOS[name]
    acting = [i for i in incidents if i.get("action") != "warn"]
    if not expected:
        return (not acting, "no intervention on a clean run" if not acting else
                f"false alarm: {[i['kind'] for i in acting]}")
    hits = [i for i in acting if i.get("kind") in expected]
    if not hits:
        return False, f"expected {'/'.join(expected)}, saw {[i['kind'] for i in acting]}"
    if target is None:
        return True, f"{hits[0]['kind']} at step {hits[0]['step']}"
    if target in ("sample", "micro_batch"):
        return _named_sample(hits, incidents, fired, target)
    if target == "lr":
        e, d = hits[0].get("evidence") or {}, hits[0].get("diagnosis") or {}
        ok = bool(e.get("lr_start")) and bool(e.get("lr_end")) and d.get("lr_cap") is not None
        return ok, (f"lr_too_high: LR {e.get('lr_start', 0):.3g} -> {e.get('lr_end', 0):.3g} "
                    f"from step {e.get('trend_start_step')}, capped at "
                    f"{d.get('lr_cap') or float('nan'):.3g}")
    injected = next((f.get(target) for f in fired if f.get(target)), None)
    for inc in hits:
        names = named_by(inc, target)
        # the first name given is the diagnosis (weight_jump lists the top three); a module
        # is named by the first overflow, the first non-finite output or the attention layer
        # the guard upcast, whichever the row has
        if injected is not None and names and (
                names[0] == injected or (target == "module" and injected in names)):
            return True, f"{inc['kind']} names {target} {injected}"
    return False, (f"{hits[0]['kind']} named {named_by(hits[0], target)[:2]}, injected "
                   f"{target} {injected}")


def _named_sample(hits: list[dict], incidents: list[dict], fired: list[dict],
                  target: str) -> tuple[bool, str]:
    """The data incidents name the injected sample (index; for ``micro_batch`` also the
    micro-batch it was in, consistent with its position) and it was quarantined."""
    injected = next((f.get("index") for f in fired if f.get("index") is not None), None)
    named = [s for h in hits for s in (h.get("evidence") or {}).get("samples") or []]
    right = [s for s in named if s.get("index") == injected]
    quarantined = any(i.get("kind") == "sample_quarantined" and
                      (i.get("evidence") or {}).get("index") == injected for i in incidents)
    wrong = sorted({s.get("index") for s in named} - {injected})
    ok = bool(right) and not wrong and quarantined
    why = (f"sample {injected} named {len(right)}x" + (f" (also {wrong})" if wrong else "")
           + (", quarantined" if quarantined else ", not quarantined"))
    if target == "micro_batch" and right:
        micros = sorted({s.get("micro_batch") for s in right})
        why += f", micro-batch {micros}"
        ok = ok and all(isinstance(m, int) for m in micros)
    return ok, why


def run_case(name: str, mode: str, a: argparse.Namespace) -> dict[str, Any]:
    """One (scenario, mode): train, then judge. Runs in a worker process with --jobs > 1."""
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg, s = make_config(name, mode, a)
    run_dir = Path(a.out) / f"{name}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # beside the run, not in it: the trainer refuses a non-empty folder that is not a run
    with open(run_dir.with_name(f"{run_dir.name}.log"), "w") as log:
        r = run_trainer(cfg, run_dir, log) if mode != "bare" else run_bare(cfg, log)
    seconds = time.perf_counter() - t0
    model, ema = r["model"], r["ema"]
    bad = (nonfinite(model) + [f"ema.{n}" for n in nonfinite(ema)]) if model is not None \
        else ["<no model>"]
    loss = eval_loss(ema, cfg, eval_batch(cfg)) if ema is not None else float("nan")
    incidents = read_incidents(run_dir) if mode == "guard" else []
    row: dict[str, Any] = {
        "name": name, "mode": mode, "finished": r["finished"], "error": r["error"],
        "finite": not bad, "nonfinite_params": bad[:5], "nonfinite_count": len(bad),
        "eval_loss": loss if math.isfinite(loss) else str(loss),
        "steps": s["steps"], "steps_done": r.get("state_step"),
        "fault_step": s["fault_step"] if SCENARIOS[name][0] else None,
        "fault": SCENARIOS[name][0], "fired": r["fired"],
        "precision": s["precision"], "batch_size": cfg.train.batch_size,
        "incidents": len(incidents),
        "incident_kinds": sorted({i["kind"] for i in incidents}),
        "incident_actions": sorted({i["action"] for i in incidents}),
        "incident_log": [{"step": i["step"], "kind": i["kind"], "action": i["action"],
                          "cost": i.get("cost") or {}} for i in incidents][:20],
        "cost": r.get("cost"), "seconds": seconds,
    }
    if "precision_end" in r:
        row["precision_end"], row["micro_batch_end"] = r["precision_end"], r["micro_batch_end"]
    if mode == "guard":
        row["diagnosis_ok"], row["diagnosis"] = diagnose(name, incidents, r["fired"])
    else:  # nothing watches: nothing is diagnosed (a clean run needs no diagnosis)
        row["diagnosis_ok"] = None if not SCENARIOS[name][0] else False
        row["diagnosis"] = "no guard"
    return row


def add_ratios(rows: list[dict]) -> None:
    """eval_loss_ratio: against the clean run of the same mode (clean_fp16 for fp16)."""
    ref = {(r["name"], r["mode"]): r["eval_loss"] for r in rows}
    for r in rows:
        base = ref.get(("clean_fp16" if r["name"] in FP16 else "clean", r["mode"]))
        v = r["eval_loss"]
        ok = isinstance(v, float) and isinstance(base, float) and base > 0
        r["eval_loss_ratio"] = v / base if ok else (None if base is None else "nan")


def bar_check(rows: list[dict]) -> dict[str, Any]:
    """Issue 3's bar for the guard rows: finished, finite, ratio <= 1.10, diagnosis."""
    fails = []
    for r in rows:
        if r["mode"] != "guard":
            continue
        ratio = r.get("eval_loss_ratio")
        why = []
        if not r["finished"]:
            why.append("did not finish")
        if not r["finite"]:
            why.append("non-finite state")
        if not isinstance(ratio, float) or ratio > 1.10:
            why.append(f"eval loss ratio {ratio}")
        if r["diagnosis_ok"] is False:
            why.append(f"diagnosis: {r['diagnosis']}")
        if why:
            fails.append({"name": r["name"], "why": why})
    return {"guard_rows_pass": not fails, "failures": fails}


# --------------------------------------------------------------------------- main


def _fmt_ratio(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


# --------------------------------------------------------------------------- outside faults

# issue 27: faults from outside the library (the user's data, the user's code between
# steps), run through the trainer with the per-step check (guard.check_every=1) and the
# deferred one (10) side by side. name -> (what is injected, the incident kind expected)
OUTSIDE: dict[str, tuple[str, str]] = {
    "data_nan_once": ("the Dataset returns one item with a NaN pixel once (a flaky read)",
                      "bad_batch"),
    "data_nan_every": ("the Dataset returns one item with a NaN pixel every time (a bad file)",
                       "bad_batch"),
    "weight_between": ("one element of a conv weight set to 4e36 between two steps, in the "
                       "middle of a window", "weight_jump"),
    "adam_state": ("Adam's exp_avg_sq of a conv weight set to 1e-30 between two steps",
                   "large_update"),
}


class _UserData(torch.utils.data.Dataset):
    """The config's dataset as a user's own: ``arm()`` makes the next item read come back
    with a NaN pixel, once or (``every``) every time that index is read."""

    def __init__(self, base, every: bool):
        self.base, self.every, self.armed, self.bad = base, every, False, None
        if hasattr(base, "num_classes"):
            self.num_classes = base.num_classes

    def __len__(self):
        return len(self.base)

    def arm(self) -> None:
        self.armed = True

    def __getitem__(self, i):
        x, *rest = self.base[i]
        if (self.armed and self.bad is None) or (self.every and self.bad == int(i)):
            if self.bad is None:
                self.bad, self.armed = int(i), False
            x = x.clone()
            x.view(-1)[5] = float("nan")
        return (x, *rest)


def run_outside(name: str | None, k: int, a: argparse.Namespace) -> dict[str, Any]:
    """One outside-fault run (``name`` None: the clean reference) with check_every ``k``."""
    from steadydiff.config import replace
    from steadydiff.data import build_dataset
    from steadydiff.trainer import loop
    cfg, s = make_config("clean", "guard", a)
    cfg = replace(cfg, {"guard.check_every": k})
    # mid-window: windows also end at each metrics row (logging.log_every), so a step
    # right after one opens a window and its mark holds the fault (then it reproduces)
    at = s["fault_step"] + 3
    data = _UserData(build_dataset(cfg.data), every=name == "data_nan_every")
    target: dict[str, Any] = {}

    def inject(state) -> None:
        pname, p = next((n, q) for n, q in state.model.named_parameters() if q.dim() == 4)
        target["param"] = pname
        with torch.no_grad():
            if name == "weight_between":
                p.view(-1)[3] = 4e36
            else:
                state.optimizer.state[p]["exp_avg_sq"].fill_(1e-30)

    real, fired = loop.train_step, []

    def step(state, batch):
        if not fired and state.step == (at - 1 if name and name.startswith("data") else at):
            fired.append(True)
            if name and name.startswith("data"):
                data.arm()  # the read for the next step
            elif name:
                inject(state)
        return real(state, batch)

    run_dir = Path(a.out) / f"outside_{name or 'clean'}_k{k}"
    shutil.rmtree(run_dir, ignore_errors=True)
    log_path = Path(a.out) / f"outside_{name or 'clean'}_k{k}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    loop.train_step = step
    captured: dict[str, Any] = {}
    orig = loop.build_state

    def capture(*args, **kw):
        captured["state"] = st = orig(*args, **kw)
        return st

    loop.build_state = capture
    out: dict[str, Any] = {"name": name or "clean", "check_every": k, "error": None}
    try:
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            loop.run(cfg, run_dir=run_dir, dataset=data, resume=False)
        out["finished"] = True
    except Exception as e:
        out.update(finished=False, error=f"{type(e).__name__}: {e}"[:200])
    finally:
        loop.train_step, loop.build_state = real, orig
    st = captured.get("state")
    out["finite"] = bool(st) and not nonfinite(st.model) and not nonfinite(st.ema.module)
    out["eval_loss"] = eval_loss(st.ema.module, cfg, eval_batch(cfg)) if st else math.nan
    incs = read_incidents(run_dir)
    expected = OUTSIDE[name][1] if name else None
    hit = next((r for r in incs if r["kind"] == expected), None)
    e = (hit or {}).get("evidence", {})
    named = ([str(x.get("index")) for x in e.get("samples", [])] or list(e.get("params", []))[:1])
    out.update(seconds=time.perf_counter() - t0, fault_step=at, incidents=len(incs),
               kinds=sorted({r["kind"] for r in incs}),
               named=f"{expected}@{hit['step']}: {','.join(named)}" if hit else "-",
               reproduced=e.get("reproduced", True) if hit else None,
               ok=None if not name else bool(
                   hit and hit["step"] == at and (
                       named == [str(data.bad)] if name.startswith("data")
                       else named == [target.get("param")])))
    return out


def outside_table(a: argparse.Namespace) -> int:
    """The outside-fault rows, per-step and deferred side by side."""
    t0 = time.perf_counter()
    rows = []
    for name in [None, *OUTSIDE]:
        for k in (1, 10):
            rows.append(run_outside(name, k, a))
            print(f"  done {rows[-1]['name']} k={k} ({rows[-1]['seconds']:.0f} s)",
                  file=sys.stderr)
    clean = {r["check_every"]: r["eval_loss"] for r in rows if r["name"] == "clean"}
    table = []
    for r in rows:
        r["eval_loss_ratio"] = r["eval_loss"] / clean[r["check_every"]]
        table.append([r["name"], r["check_every"], "yes" if r["finished"] else "NO",
                      "yes" if r["finite"] else "NO", _fmt_ratio(r["eval_loss_ratio"]),
                      ",".join(r["kinds"]) or "-", r["named"],
                      {True: "yes", False: "NO", None: "-"}[r["ok"]],
                      {True: "yes", False: "no", None: "-"}[r["reproduced"]]])
    print(f"outside faults: {a.steps} steps, fault at step {a.fault_step + 3} "
          f"(mid-window), snapshots every {a.snapshot_every}")
    print_table(table, ["scenario", "check_every", "finished", "finite", "eval/clean",
                        "kinds", "named cause", "= injected", "reproduced"])
    bar = all(r["finished"] and r["finite"] and r["eval_loss_ratio"] <= 1.10
              and r["ok"] is not False for r in rows)
    print(f"every row meets the bar (finite, eval <= 1.10x clean, cause named): {bar}")
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    if a.json:
        print(json.dumps({"bench": "stability_outside", "rows": rows, "bar": bar,
                          **env_info()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for every run")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                   help="comma list; 'clean' (and 'clean_fp16' for fp16_overflow) is added "
                   "when a faulty scenario needs its reference")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of guard, off, bare")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    p.add_argument("--fault-step", type=int, default=None, help="default: steps // 2")
    p.add_argument("--snapshot-every", type=int, default=50)
    p.add_argument("--fp16-steps", type=int, default=8,
                   help="fp16 scenarios on a CPU: steps (fault at half)")
    p.add_argument("--fp16-batch", type=int, default=4, help="fp16 scenarios on a CPU: batch")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=str(REPO / "runs" / "bench_stability"),
                   help="run directories (incidents.jsonl) and their NAME.log go here")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--outside", action="store_true",
                   help="the outside-fault table (issue 27): the user's data and code, "
                   "guard.check_every 1 and 10 side by side")
    a = p.parse_args(argv)
    if a.outside:
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.fault_step is None:
            a.fault_step = a.steps // 2
        a.out = str(Path(a.out).resolve())
        return outside_table(a)

    if a.threads:
        torch.set_num_threads(a.threads)  # (each run sets it again in its own process)
    names = [s for s in a.scenarios.split(",") if s]
    if "diagnosis" in names:  # the issue-13 table
        i = names.index("diagnosis")
        names[i:i + 1] = list(DIAGNOSIS)
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; valid: {', '.join(SCENARIOS)}")
    if any(n not in FP16 and n != "clean" for n in names) and "clean" not in names:
        names.insert(0, "clean")
    fp16 = [n for n in names if n in FP16 and n != "clean_fp16"]
    if fp16 and "clean_fp16" not in names:  # their reference
        names.insert(names.index(fp16[0]), "clean_fp16")
    modes = [m for m in a.modes.split(",") if m]
    cases = [(n, m) for n in names for m in modes]
    if a.fault_step is None:
        a.fault_step = a.steps // 2
    a.out = str(Path(a.out).resolve())

    t0 = time.perf_counter()
    rows: list[dict] = []
    print(f"{len(cases)} runs, {a.jobs} at a time; run dirs under {a.out}", file=sys.stderr)
    if a.jobs > 1:
        with cf.ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as ex:
            futs = {ex.submit(run_case, n, m, a): (n, m) for n, m in cases}
            for f in cf.as_completed(futs):
                rows.append(f.result())
                print(f"  done {rows[-1]['name']}/{rows[-1]['mode']} "
                      f"({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
    else:
        for n, m in cases:
            rows.append(run_case(n, m, a))
            print(f"  done {n}/{m} ({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
    order = {c: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: order[(r["name"], r["mode"])])
    add_ratios(rows)
    check = bar_check(rows)

    print(f"stability: {a.steps} steps (fault at step {a.fault_step}), snapshots every "
          f"{a.snapshot_every}; fp16 rows: {case_settings('fp16_overflow', a)['steps']} steps, "
          f"batch {case_settings('fp16_overflow', a)['batch_size'] or 'as configured'}")
    table = []
    for r in rows:
        c = r.get("cost") or {}
        cost = (f"redo {c.get('steps_redone', 0)}, skip {c.get('batches_skipped', 0)}b/"
                f"{c.get('skipped_steps', 0) + c.get('fp16_overflow_skips', 0)}s"
                + (f", drop {c['samples_dropped']} sample(s)" if c.get("samples_dropped")
                   else "") if c else "-")
        table.append([r["name"], r["mode"], "yes" if r["finished"] else "NO",
                      "yes" if r["finite"] else "NO", _fmt_ratio(r["eval_loss_ratio"]),
                      r["incidents"], ",".join(r["incident_kinds"]) or "-",
                      ",".join(r["incident_actions"]) or "-", cost,
                      {True: "yes", False: "no", None: "-"}[r["diagnosis_ok"]],
                      r["diagnosis"][:70], (r["error"] or "")[:50]])
    print_table(table, ["scenario", "mode", "finished", "finite", "eval/clean", "inc",
                        "kinds", "actions", "cost", "diag", "named cause", "error"])
    print(f"guard rows meet the bar: {check['guard_rows_pass']}"
          + "".join(f"\n  {f['name']}: {'; '.join(f['why'])}" for f in check["failures"]))
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    if a.json:
        result = {"bench": "stability", "settings": {
            "config": a.config, "overrides": a.set, "steps": a.steps,
            "fault_step": a.fault_step, "snapshot_every": a.snapshot_every,
            "fp16_steps": a.fp16_steps, "fp16_batch": a.fp16_batch, "threads": a.threads,
            "jobs": a.jobs, "device": a.device},
            "expected": {k: {"kinds": list(v[1]), "names": v[2]} for k, v in SCENARIOS.items()},
            "scenarios": rows, "bar": check, "wall_seconds": time.perf_counter() - t0}
        result.update(env_info())
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
