"""Post-hoc EMA reconstruction (Karras et al. 2024, "Analyzing and Improving the Training
Dynamics of Diffusion Models", EDM2 §3.2 and appendix C.2): the EMA of any length, after
training, from the stored snapshots of a few power-function EMA profiles.

A run with ``train.ema_posthoc`` stores, every ``train.ema_posthoc_every`` steps, a snapshot of
each profile (``RUN/posthoc/step_*.safetensors``; :mod:`steadydiff.trainer.posthoc`). Snapshot
``i`` is a known weighted average ``sum_tau a_i[tau] theta_tau`` of the weights after each
update ``tau``: its kernel ``a_i`` follows exactly from the profile's exponent and the snapshot's
update count (:func:`~steadydiff.trainer.posthoc.profile_weights`). The EMA wanted, a power
function of ``sigma_rel`` evaluated at the end, has a kernel ``w`` too. We solve

    min_c || sum_i c_i a_i - w ||^2   over the update index tau = 1..T,   sum_i c_i = 1

and return ``sum_i c_i snapshot_i``. EDM2 solves the same problem in continuous time with the
kernels' inner products in closed form; here the kernels are the exact discrete ones of our
update rule, so when the target equals a stored profile at the last snapshot the answer is
that snapshot (up to float rounding). The constraint keeps the reconstruction's total weight
exactly 1 (see :func:`solve`). Very long runs are fitted on every ``stride``-th update
(a quadrature of the same sum; the kernels are smooth in ``tau``).

The reconstructed EMA is written as a normal verified checkpoint (the newest checkpoint's
model, optimizer and state with the EMA replaced), which ``steadydiff sample`` and
``steadydiff eval`` read. :func:`sweep` evaluates a range of ``sigma_rel`` with the project's
own evaluation (:func:`steadydiff.eval.evaluate.evaluate_samples`), writes
``RUN/posthoc/sweep.{json,md,png}``, and writes the best as ``RUN/checkpoints/posthoc_best``,
the checkpoint ``steadydiff sample RUN`` prefers (docs/ema.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from .config import SIGMA_REL_MAX
from .rundir import RunDir
from .trainer import checkpoint as ckpt
from .trainer.posthoc import profile_weights, sigma_rel_to_gamma

# the fit runs on at most this many (update, column) entries; longer runs use a stride
_MAX_ENTRIES = 20_000_000
DEFAULT_SWEEP = (0.02, 0.03, 0.04, 0.05, 0.065, 0.08, 0.10, 0.13, 0.16, 0.20, 0.25)


class PosthocError(ValueError):
    """A post-hoc EMA that cannot be reconstructed as asked (exit code 2); the message says
    what is missing and what would be valid."""


@dataclasses.dataclass
class Snapshots:
    """The usable snapshots of a run, as its newest intact checkpoint lists them."""

    run: RunDir
    checkpoint: Path
    sigma_rels: tuple[float, ...]
    entries: list[dict[str, Any]]   # {step, num_updates, file, size, sha256}
    skipped: list[str]              # snapshots left out, and why

    @property
    def num_updates(self) -> int:
        """The target time: the newest snapshot's update count."""
        return max(e["num_updates"] for e in self.entries)


def check_sigma_rel(sigma_rel: float) -> float:
    if not (isinstance(sigma_rel, (int, float)) and 0.0 < sigma_rel < SIGMA_REL_MAX):
        raise PosthocError(f"--sigma-rel {sigma_rel}: out of range; a power-function EMA's "
                           f"sigma_rel is in (0, {SIGMA_REL_MAX:.4f}) (EDM2 uses 0.05-0.20; "
                           "0.2886 would be a uniform average of the whole run)")
    return float(sigma_rel)


def find_snapshots(run_dir: str | Path) -> Snapshots:
    """The snapshots the newest intact checkpoint of ``run_dir`` lists, each verified
    against its recorded size and sha256 (a damaged or missing one is skipped and named).

    Raises:
        PosthocError: not a run, a run trained without ``train.ema_posthoc``, or fewer than
            two usable snapshots.
    """
    run = RunDir(Path(run_dir))
    if not run.root.is_dir() or not run.checkpoints.is_dir():
        raise PosthocError(f"{run.root}: not a steadydiff run directory (no checkpoints/); "
                           "pass the --out directory of a `steadydiff train` run")
    path = run.latest_good()
    if path is None:
        raise PosthocError(f"{run.checkpoints}: no intact checkpoint to reconstruct from")
    state = json.loads((path / "state.json").read_text())
    meta = (state.get("ema") or {}).get("posthoc")
    if not meta:
        raise PosthocError(
            f"{run.root} was trained without post-hoc EMA snapshots ({path.name} has none): "
            "train with --set train.ema_posthoc=true (and train.ema_posthoc_every=N, the "
            "steps between snapshots) to reconstruct an EMA after training")
    entries, skipped = [], []
    for e in meta["snapshots"]:
        f = run.posthoc / e["file"]
        why = None
        if not f.is_file():
            why = "missing"
        elif f.stat().st_size != e["size"]:
            why = f"size {f.stat().st_size}, recorded {e['size']} (truncated or replaced)"
        elif ckpt.sha256_of(f) != e["sha256"]:
            why = "sha256 does not match the checkpoint's record (corrupted or replaced)"
        if why:
            skipped.append(f"{f}: {why}")
        else:
            entries.append(dict(e))
    sigma_rels = tuple(float(s) for s in meta["sigma_rels"])
    if len(entries) < 2:
        raise PosthocError(
            f"{run.root}: {len(entries)} usable post-hoc EMA snapshot(s) (listed by "
            f"{path.name}: {len(meta['snapshots'])}"
            + (f"; skipped: {'; '.join(skipped)}" if skipped else "")
            + "); a reconstruction needs at least 2, and works well with ~10 or more: train "
            "longer, or with a smaller train.ema_posthoc_every")
    return Snapshots(run, path, sigma_rels, entries, skipped)


def solve(snaps: Snapshots, sigma_rel: float) -> dict[str, Any]:
    """The least-squares coefficients of every (snapshot, profile) for the power-function
    EMA of ``sigma_rel`` at the newest snapshot's update count.

    Returns:
        ``{sigma_rel, gamma, num_updates, stride, columns: [(file, profile index)],
        coefficients, residual}``; ``residual`` is ``||A c - w|| / ||w||``, the kernel's
        relative fit error (0: exact; a few percent: close).
    """
    sigma_rel = check_sigma_rel(sigma_rel)
    T = snaps.num_updates
    gammas = [sigma_rel_to_gamma(s) for s in snaps.sigma_rels]
    cols = [(e, k) for e in snaps.entries for k in range(len(gammas))]
    stride = max(1, math.ceil(T * (len(cols) + 1) / _MAX_ENTRIES))
    rows = np.arange(T - 1, -1, -stride)[::-1]  # always keep the last update
    A = np.stack([profile_weights(gammas[k], e["num_updates"], T)[rows] for e, k in cols], 1)
    g = sigma_rel_to_gamma(sigma_rel)
    w = profile_weights(g, T)[rows]
    # subject to sum(c) = 1: every kernel sums to 1, so the reconstruction's total weight is
    # exactly 1 (a weight that never moved comes out unchanged). Unconstrained, a kernel fit
    # off by 0.1% in mass puts 0.1% of the whole weight vector into the error, which at small
    # N dominated it. Eliminate the last coefficient: c_K = 1 - sum(z), A c = a_K + B z.
    B, a_K = A[:, :-1] - A[:, -1:], A[:, -1]
    z = np.linalg.lstsq(B, w - a_K, rcond=None)[0] if B.shape[1] else np.zeros(0)
    c = np.append(z, 1.0 - z.sum())
    residual = float(np.linalg.norm(A @ c - w) / np.linalg.norm(w))
    return {"sigma_rel": sigma_rel, "gamma": g, "num_updates": T, "stride": stride,
            "columns": [(e["file"], k) for e, k in cols],
            "coefficients": [float(v) for v in c], "residual": residual}


def reconstruct(snaps: Snapshots, sigma_rels: Sequence[float]
                ) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """The EMAs of ``sigma_rels`` (fp32 CPU tensors of the trainable parameters, and the
    fit's record), reading every snapshot once (float64 accumulation)."""
    fits = [solve(snaps, s) for s in sigma_rels]
    acc: list[dict[str, torch.Tensor]] = [{} for _ in fits]
    for e in snaps.entries:
        sd = load_file(str(snaps.run.posthoc / e["file"]))
        for k in range(len(snaps.sigma_rels)):
            prefix = f"{k}/"
            col = fits[0]["columns"].index((e["file"], k))
            for name, v in sd.items():
                if not name.startswith(prefix):
                    continue
                key = name[len(prefix):]
                for fit, out in zip(fits, acc):
                    term = v.double() * fit["coefficients"][col]
                    out[key] = out[key] + term if key in out else term
    return [({k: v.float() for k, v in out.items()}, fit) for out, fit in zip(acc, fits)]


def _with_ema(c: ckpt.Checkpoint, ema: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's EMA state dict with the reconstructed trainable tensors in it."""
    missing = sorted(set(ema) - set(c.ema))
    if missing:
        raise PosthocError(f"{c.path}: the snapshots hold tensors its EMA has not "
                           f"({missing[:3]}); were they written by another run?")
    return {k: (ema[k].to(v.dtype) if k in ema else v) for k, v in c.ema.items()}


def _record(fit: dict[str, Any], snaps: Snapshots) -> dict[str, Any]:
    return {"sigma_rel": fit["sigma_rel"], "gamma": fit["gamma"],
            "num_updates": fit["num_updates"], "residual": fit["residual"],
            "stride": fit["stride"], "coefficient_sum": float(sum(fit["coefficients"])),
            "snapshots": len(snaps.entries), "profiles": list(snaps.sigma_rels),
            "source": str(snaps.checkpoint), "skipped": snaps.skipped}


def _check_out(out: Path, force: bool) -> None:
    """Refuse to replace anything that is not a post-hoc checkpoint, or one without ``force``."""
    if not out.exists():
        return
    ours = (out / "state.json").is_file() and \
        "posthoc_ema" in json.loads((out / "state.json").read_text())
    if not ours:
        raise PosthocError(f"--out {out} exists and is not a post-hoc EMA checkpoint; "
                           "choose a new path (nothing was written)")
    if not force:
        raise PosthocError(f"--out {out} exists (a post-hoc EMA checkpoint); pass --force to "
                           "replace it, or choose a new path (nothing was written)")


def write(c: ckpt.Checkpoint, ema: dict[str, torch.Tensor], record: dict[str, Any],
          out: Path) -> Path:
    """Write checkpoint ``c`` with its EMA replaced by ``ema`` at ``out`` (a verified
    checkpoint directory; for sampling and evaluation, not for resuming training)."""
    state = {**c.state, "posthoc_ema": record}
    return ckpt.write_checkpoint_dir(out, c.step, model=c.model, ema=_with_ema(c, ema),
                                     optimizer=c.optimizer or {}, state=state)


def default_out(run: RunDir, sigma_rel: float) -> Path:
    return run.checkpoints / f"posthoc_{sigma_rel:g}"


def reconstruct_to(run_dir: str | Path, sigma_rel: float, out: str | Path | None = None, *,
                   force: bool = False) -> tuple[Path, dict[str, Any]]:
    """``steadydiff ema RUN --sigma-rel S``: reconstruct one EMA and write its checkpoint
    (default ``RUN/checkpoints/posthoc_<S>``). Returns the path and the fit's record."""
    check_sigma_rel(sigma_rel)
    snaps = find_snapshots(run_dir)
    path = Path(out) if out is not None else default_out(snaps.run, sigma_rel)
    _check_out(path, force)
    c = ckpt.load_checkpoint(snaps.checkpoint)
    [(ema, fit)] = reconstruct(snaps, [sigma_rel])
    record = _record(fit, snaps)
    return write(c, ema, record, path), record


# --------------------------------------------------------------------------- sweep


class Measure:
    """Sample from checkpoint ``c`` with its EMA replaced, and evaluate the samples with the
    project's offline metric (:func:`~steadydiff.eval.evaluate.evaluate_samples`): the same
    noise, labels and real subset for every EMA measured, so their FDs compare."""

    def __init__(self, c: ckpt.Checkpoint, *, num: int = 500, sampler: str | None = None,
                 steps: int | None = None, seed: int = 0, device: str | None = None,
                 verbose: bool = True):
        from .devices import resolve_device
        from .diffusion import make_schedule
        from .eval.evaluate import extractor_for
        from .kinds import LABELLED_DATASETS
        from .loading import checkpoint_config

        self.c, self.cfg = c, checkpoint_config(c)
        self.num, self.sampler, self.steps, self.seed = num, sampler, steps, seed
        self.device = resolve_device(device, what="device")
        if self.cfg.data.dataset not in LABELLED_DATASETS:
            raise PosthocError(
                f"--sweep evaluates with the offline FD of a labelled dataset "
                f"({' or '.join(LABELLED_DATASETS)}); this run trained on "
                f"{self.cfg.data.dataset}: reconstruct single values with --sigma-rel and "
                "evaluate them with `steadydiff eval --inception-weights`")
        self.fx = extractor_for(self.cfg, verbose=verbose)
        self.schedule = make_schedule(self.cfg.diffusion, self.cfg.data.image_size)

    def __call__(self, ema: dict[str, torch.Tensor], floor: bool = False) -> dict[str, Any]:
        """The figures of the EMA ``ema`` (trainable tensors; ``{}``: the checkpoint's own);
        ``floor`` adds the real-vs-real FD at the same N (``real_floor_fd``)."""
        from .eval.evaluate import evaluate_samples
        from .loading import Pipeline, build_from_checkpoint

        c = dataclasses.replace(self.c, ema=_with_ema(self.c, ema))
        model = build_from_checkpoint(c, self.cfg).to(self.device)
        pipe = Pipeline(model, self.schedule, self.cfg, self.device, c.path, c.step)
        x, y = pipe.sample(self.num, sampler=self.sampler, steps=self.steps, seed=self.seed,
                           allow_nonfinite=True)
        return _figures(evaluate_samples(self.fx, x, y, seed=self.seed, real_floor=floor))



def sweep(run_dir: str | Path, sigma_rels: Sequence[float] = DEFAULT_SWEEP, *, num: int = 500,
          sampler: str | None = None, steps: int | None = None, seed: int = 0,
          device: str | None = None, force: bool = False, verbose: bool = True
          ) -> dict[str, Any]:
    """Evaluate the post-hoc EMA at each of ``sigma_rels`` (and the run's own EMA, for
    reference) with ``num`` samples each, write the table and plot into ``RUN/posthoc/``
    and the best one (lowest FD) as ``RUN/checkpoints/posthoc_best``.

    Returns:
        ``{metric, rows: [{sigma_rel, fd, kid, precision, recall, residual, ...}], fixed:
        {ema_decay, fd, ...}, real_floor_fd, best: {sigma_rel, fd, checkpoint}, files}``.
    """
    rels = [check_sigma_rel(s) for s in sigma_rels]
    if not rels:
        raise PosthocError("--sweep needs at least one sigma_rel")
    snaps = find_snapshots(run_dir)
    run = snaps.run
    files = {k: run.posthoc / f"sweep.{k}" for k in ("json", "md", "png")}
    if not force:
        there = [str(p) for p in [*files.values(), run.posthoc_best] if p.exists()]
        if there:
            raise PosthocError(f"a sweep was already written ({', '.join(there)}); pass "
                               "--force to replace it (nothing was written)")
    elif run.posthoc_best.exists():
        _check_out(run.posthoc_best, force=True)
    c = ckpt.load_checkpoint(snaps.checkpoint)
    measure = Measure(c, num=num, sampler=sampler, steps=steps, seed=seed, device=device,
                      verbose=verbose)
    cfg = measure.cfg
    fixed = {"ema_decay": cfg.train.ema_decay, **measure({}, floor=True)}
    real_floor = fixed.pop("real_floor_fd", None)
    rows, recons = [], reconstruct(snaps, rels)
    for ema, fit in recons:
        res = measure(ema)
        res.pop("real_floor_fd", None)
        rows.append({"sigma_rel": fit["sigma_rel"], **res, "residual": fit["residual"]})
        if verbose:
            print(f"  sigma_rel {fit['sigma_rel']:<6g} FD {_fmt(res.get('fd'))} "
                  f"(fit residual {fit['residual']:.2g})")
    finite = [i for i, r in enumerate(rows) if r.get("fd") is not None]
    if not finite:
        raise PosthocError("no sigma_rel gave a measurable FD (every sample non-finite?)")
    ib = min(finite, key=lambda i: rows[i]["fd"])
    best_ema, best_fit = recons[ib]
    best_path = write(c, best_ema, {**_record(best_fit, snaps), "chosen_by": "sweep",
                                    "fd": rows[ib]["fd"]}, run.posthoc_best)
    result = {"metric": f"FD-{cfg.data.dataset}", "num": num, "step": c.step, "sampler":
              sampler or cfg.sample.sampler, "steps": steps or cfg.sample.steps, "seed": seed,
              "rows": rows, "fixed": fixed, "real_floor_fd": real_floor,
              "best": {"sigma_rel": rows[ib]["sigma_rel"], "fd": rows[ib]["fd"],
                       "checkpoint": str(best_path)},
              "snapshots": len(snaps.entries), "skipped": snaps.skipped,
              "files": {k: str(v) for k, v in files.items()}}
    run.posthoc.mkdir(parents=True, exist_ok=True)
    files["json"].write_text(json.dumps(result, indent=1))
    files["md"].write_text(sweep_markdown(result))
    plot_sweep(result, files["png"])
    return result


def _figures(res: dict[str, Any]) -> dict[str, Any]:
    out = {k: res.get(k) for k in ("fd", "kid", "precision", "recall", "class_accuracy")}
    out["real_floor_fd"] = (res.get("real_floor") or {}).get("fd")
    return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def sweep_markdown(res: dict[str, Any]) -> str:
    """The sweep's table (markdown)."""
    m = res["metric"]
    lines = [f"# Post-hoc EMA sweep (step {res['step']}, {res['num']} samples, "
             f"{res['sampler']} {res['steps']} steps, {res['snapshots']} snapshots)", "",
             f"| EMA | {m} | KID | precision | recall | fit residual |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        star = " **best**" if r["sigma_rel"] == res["best"]["sigma_rel"] else ""
        lines.append(f"| post-hoc sigma_rel={r['sigma_rel']:g}{star} | {_fmt(r['fd'])} | "
                     f"{_fmt(r['kid'], '.4f')} | {_fmt(r['precision'], '.2f')} | "
                     f"{_fmt(r['recall'], '.2f')} | {r['residual']:.2g} |")
    f = res["fixed"]
    lines.append(f"| the run's EMA (ema_decay={f['ema_decay']:g}) | {_fmt(f['fd'])} | "
                 f"{_fmt(f['kid'], '.4f')} | {_fmt(f['precision'], '.2f')} | "
                 f"{_fmt(f['recall'], '.2f')} | |")
    lines += ["", f"real-vs-real floor ({m}, same N): {_fmt(res['real_floor_fd'])}",
              f"best: sigma_rel={res['best']['sigma_rel']:g} -> {res['best']['checkpoint']}", ""]
    return "\n".join(lines)


def plot_sweep(res: dict[str, Any], path: Path) -> Path:
    """FD against sigma_rel (log axis), with the run's own EMA and the real-vs-real floor."""
    import matplotlib  # imported when first used (docs/architecture.md)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r.get("fd") is not None]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    ax.plot([r["sigma_rel"] for r in rows], [r["fd"] for r in rows], "o-", label="post-hoc EMA")
    ax.plot([res["best"]["sigma_rel"]], [res["best"]["fd"]], "r*", ms=12,
            label=f"best: sigma_rel={res['best']['sigma_rel']:g}")
    if res["fixed"].get("fd") is not None:
        ax.axhline(res["fixed"]["fd"], color="gray", ls="--",
                   label=f"run's EMA (decay {res['fixed']['ema_decay']:g})")
    if res.get("real_floor_fd") is not None:
        ax.axhline(res["real_floor_fd"], color="green", ls=":", label="real-vs-real floor")
    ax.set_xscale("log")
    ax.set_xlabel("sigma_rel")
    ax.set_ylabel(res["metric"])
    ax.set_title(f"post-hoc EMA sweep, step {res['step']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
