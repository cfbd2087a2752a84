"""The command line: ``steadydiff train | sample | eval | ema | report | doctor | merge |
export | condition``.

Thin by design: parse arguments, build a config, call a library function. Exit codes:
0 finished (with or without recoveries), 2 bad input (config, data, checkpoint, arguments, a
device that is unknown or absent, non-finite samples, a run directory that cannot be used:
not a run, in use by a live process, no intact checkpoint), 3 aborted because instability persisted past the recovery budget, 4 a checkpoint could not be
written (disk full, permission denied) with train.on_save_error=stop, 5 (torchrun) the process
group failed: another rank died or hung past train.dist_timeout / train.watchdog_timeout,
6 interrupted by SIGTERM, SIGINT or SIGUSR1 (preemption, Ctrl-C, a requeue script): the step
in progress finished, a verified checkpoint of it was written, and rerunning the same command
resumes exactly; 128+N (130, 138, 143) a second signal N stopped the run at once, without a
checkpoint of the current step (the newest checkpoint is intact).

Each command imports the library parts it needs when it runs (the imports inside the
``cmd_*`` functions and ``main`` are deliberate): ``steadydiff --help`` never imports torch,
which takes seconds. ``train --dry-run`` does: it builds the model (on the meta device) and
the data, so it approves only what would start (:mod:`steadydiff.preflight`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

from . import __version__
from .kinds import CONDITION_KINDS, SAMPLER_NAMES

EXIT_OK, EXIT_BAD_INPUT, EXIT_ABORTED, EXIT_SAVE_FAILED = 0, 2, 3, 4
EXIT_INTERRUPTED = 6  # = trainer.preempt.EXIT_INTERRUPTED (not imported: it imports torch)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default once: appended when the parser holds a value, left out
    when the help already says it (``default: auto``), for flags, and for None (the command
    resolves it: the help says how)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default in (None, argparse.SUPPRESS) or action.nargs == 0
                or re.search(r"\bdefault\b", text, re.I)):
            return text
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="steadydiff", formatter_class=_Formatter,
        description="Train diffusion models that do not crash.",
        epilog="exit codes: 0 finished (with or without recoveries), 2 bad input, 3 aborted "
               "(instability past the recovery budget), 4 could not write a checkpoint, "
               "5 distributed failure (a rank died or hung), 6 interrupted by SIGTERM/"
               "SIGINT/SIGUSR1 after checkpointing the current step (rerun the same "
               "command to resume), 128+N a second signal N stopped it at once. "
               "Multi-process: "
               "torchrun --nproc_per_node=N -m steadydiff train CONFIG (docs/distributed.md)")
    p.add_argument("--version", action="version", version=f"steadydiff {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", formatter_class=_Formatter,
                       help="train (or resume) a run from a YAML config",
                       description="Train from a YAML config. Rerunning the same command "
                                   "resumes from the run's newest intact checkpoint.")
    t.add_argument("config", help="YAML config file (see configs/)")
    t.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="override a config value; repeat for several (--set a.b=1 --set "
                        "c.d=2; --set a.b=1 c.d=2 also works and never takes the config path)")
    t.add_argument("--out", default=None,
                   help="run directory (default: runs/<config file name>)")
    t.add_argument("--dry-run", action="store_true",
                   help="make every check a run makes before its first step (device, "
                        "precision, data and its classes, the model built on the meta device "
                        "and run once) without training; print the resolved config and exit")
    t.add_argument("--print-config", action="store_true",
                   help="print the whole resolved config at start, what differs from the "
                        "defaults first (it is always written to RUN_DIR/config.yaml; the "
                        "terminal gets a short header; --dry-run alone prints only the keys "
                        "that differ)")
    t.add_argument("--resume", default=None, metavar="PATH",
                   help="resume from this checkpoint or run directory")
    t.add_argument("--no-resume", action="store_true",
                   help="start fresh; refuses if the run directory already has checkpoints")
    t.add_argument("--restart", action="store_true",
                   help="start over at step 0: the run directory's files are moved to "
                        "OUT/previous-<time>/ first (nothing is deleted)")
    t.add_argument("--allow-config-change", action="store_true",
                   help="accept config changes on resume that break exactness")
    t.add_argument("--grow-resolution", action="store_true",
                   help="continue a run at a larger data.image_size (give it with --set "
                        "data.image_size=N): weights, EMA and optimizer carry over, the "
                        "guard's statistics restart (docs/resolution.md)")

    s = sub.add_parser("sample", formatter_class=_Formatter,
                       help="sample from a checkpoint into a PNG grid or an .npz array",
                       description="Sample from a trained model (EMA weights by default). "
                                   "Defaults for unset options come from the checkpoint's "
                                   "config (its sample section).")
    s.add_argument("checkpoint", help="checkpoint directory, or a run directory (newest "
                                      "intact checkpoint)")
    s.add_argument("--sampler", choices=SAMPLER_NAMES, default=None,
                   help="default: the checkpoint config's sample.sampler")
    s.add_argument("--steps", type=int, default=None, help="sampling steps (default: sample.steps)")
    s.add_argument("--num", type=int, default=None, help="number of samples (default: sample.num)")
    s.add_argument("--width", type=int, default=None,
                   help="text-to-image model: the image width in pixels (a multiple of the "
                        "VAE's x the denoiser's downsampling; default: the model's native "
                        "size)")
    s.add_argument("--height", type=int, default=None,
                   help="text-to-image model: the image height in pixels (default: the "
                        "model's native size)")
    s.add_argument("--class-label", type=int, default=None,
                   help="class for a class-conditional model (default: cycle through all)")
    s.add_argument("--prompt", action="append", default=None,
                   help="text-to-image model: the prompt (repeat for several; the samples "
                        "cycle through them; default: sample.prompts)")
    s.add_argument("--negative-prompt", default=None,
                   help="text-to-image model: what guidance steers away from (default: "
                        "sample.negative_prompt)")
    s.add_argument("--cfg-scale", type=float, default=None,
                   help="classifier-free guidance scale (default: sample.cfg_scale)")
    s.add_argument("--eta", type=float, default=None,
                   help="DDIM stochasticity (default: sample.eta)")
    s.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: sample.seed)")
    s.add_argument("--raw-weights", action="store_true",
                   help="use the raw model weights instead of the EMA")
    s.add_argument("--device", default=None,
                   help="auto (CUDA if available), cpu, cuda, cuda:N, mps (default: auto)")
    s.add_argument("--adapter-scale", type=float, default=None,
                   help="adapter checkpoint: apply the adapter at this scale (0: the base "
                        "model; default 1)")
    s.add_argument("--base", default=None,
                   help="adapter checkpoint: its base weights; a Stable Diffusion run: its "
                        "model.pretrained; if they moved since training (the identity the "
                        "run recorded is checked)")
    s.add_argument("--control-image", default=None, metavar="FILE",
                   help="ControlNet run: the conditioning image (resized to data.image_size)")
    s.add_argument("--control-scale", type=float, default=None,
                   help="ControlNet run: its residuals x this (default: controlnet.scale)")
    s.add_argument("--control-start", type=float, default=None,
                   help="ControlNet run: the fraction of the steps after which the control "
                        "acts (default: controlnet.start)")
    s.add_argument("--control-end", type=float, default=None,
                   help="ControlNet run: the fraction of the steps after which it stops "
                        "(default: controlnet.end)")
    s.add_argument("--lora", action="append", default=None, metavar="FILE[:SCALE]",
                   help="Stable Diffusion run: fuse this LoRA (a diffusers or kohya/A1111 "
                        ".safetensors, or a folder with pytorch_lora_weights.safetensors) "
                        "into the base first, at SCALE (default 1); repeatable. With a "
                        "ControlNet run: LoRA and ControlNet together")
    s.add_argument("--out", required=True,
                   help="output: a .png grid, or .npz with 'samples' (N,C,H,W) float32 in "
                        "[-1,1] (and 'labels' when class-conditional); a new file, written "
                        "atomically")
    s.add_argument("--force", action="store_true",
                   help="replace an existing --out file (never a directory or an input)")

    e = sub.add_parser("eval", formatter_class=_Formatter,
                       help="measure sample quality: FD, KID, precision/recall (offline)",
                       description="Sample N images (EMA weights) and compare them with N real "
                                   "images of the run's dataset in the feature space of a small "
                                   "classifier trained and cached for that dataset (FD-digits, "
                                   "FD-fashion_mnist: not comparable with Inception FID), with "
                                   "KID, precision/recall and class accuracy; true FID with "
                                   "--inception-weights. See docs/evaluation.md.")
    _eval_arguments(e)

    x = sub.add_parser("ema", formatter_class=_Formatter,
                       help="post-hoc EMA: reconstruct the EMA of any length after training",
                       description="Reconstruct, by least squares over the power-function EMA "
                                   "snapshots a run stored (train.ema_posthoc=true), the EMA "
                                   "of relative width --sigma-rel (Karras et al. 2024, EDM2), "
                                   "and write it as a checkpoint that `steadydiff sample` and "
                                   "`steadydiff eval` read. --sweep evaluates a range of "
                                   "sigma_rel, writes RUN/posthoc/sweep.{json,md,png} and the "
                                   "best as RUN/checkpoints/posthoc_best, which `steadydiff "
                                   "sample RUN` then prefers. See docs/ema.md.")
    x.add_argument("run_dir", help="run directory trained with train.ema_posthoc=true")
    x.add_argument("--sigma-rel", type=float, default=None,
                   help="the EMA's relative width, in (0, 0.2886); EDM2's best are ~0.05-0.2")
    x.add_argument("--out", default=None,
                   help="checkpoint directory to write (default: "
                        "RUN/checkpoints/posthoc_<sigma_rel>); an existing one is refused "
                        "without --force")
    x.add_argument("--sweep", action="store_true",
                   help="evaluate several sigma_rel (--sigma-rels) and mark the best")
    x.add_argument("--sigma-rels", default=None, metavar="S1,S2,...",
                   help="--sweep: the values to evaluate (default: 0.02,0.03,0.04,0.05,0.065,"
                        "0.08,0.1,0.13,0.16,0.2,0.25)")
    x.add_argument("--num", type=int, default=500, help="--sweep: samples per evaluation")
    x.add_argument("--sampler", choices=SAMPLER_NAMES, default=None,
                   help="--sweep: default: the checkpoint config's sample.sampler")
    x.add_argument("--steps", type=int, default=None,
                   help="--sweep: sampling steps (default: sample.steps)")
    x.add_argument("--seed", type=int, default=0, help="--sweep: sampling and subset seed")
    x.add_argument("--device", default=None, help="--sweep: cpu, cuda, ... (default: auto)")
    x.add_argument("--force", action="store_true",
                   help="replace an existing post-hoc checkpoint / sweep (never anything else)")

    r = sub.add_parser("report", formatter_class=_Formatter,
                       help="write a run's self-contained HTML health report",
                       description="Write RUN_DIR/report.html: verdict, loss/gradient/LR "
                                   "plots, incidents on the timeline, per-layer gradient heat "
                                   "map, sample grids and the incident table, in one file "
                                   "that opens in any browser with no network.")
    r.add_argument("run_dir", help="run directory (a partial or aborted run is fine)")
    r.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html)")

    m = sub.add_parser("merge", formatter_class=_Formatter,
                       help="bake a LoRA adapter into its base weights (a full checkpoint)",
                       description="Merge a LoRA adapter checkpoint into its base weights and "
                                   "write a normal, full steadydiff checkpoint under "
                                   "OUT/checkpoints/ (model = base + adapter, EMA = base + "
                                   "EMA adapter), which `steadydiff sample` and "
                                   "steadydiff.load read like any run. OUT must not exist.")
    m.add_argument("checkpoint", help="adapter checkpoint, or its run directory")
    m.add_argument("--scale", type=float, default=1.0, help="adapter scale baked in")
    m.add_argument("--base", default=None,
                   help="the base weights, if they moved since training")
    m.add_argument("--out", required=True, help="new run directory for the merged checkpoint")

    xp = sub.add_parser("export", formatter_class=_Formatter,
                        help="write a trained model as one .safetensors file: --out for "
                             "steadydiff's UNet/DiT (any checkpoint, FSDP-sharded included), "
                             "--single-file for a Stable Diffusion fine-tune (the original "
                             "layout A1111/ComfyUI load)",
                        description="--out FILE: the model of a run or checkpoint of "
                                    "steadydiff's own UNet/DiT (a sharded FSDP checkpoint is "
                                    "consolidated in this process), its EMA weights "
                                    "(--raw-weights: the raw ones), with its config in the "
                                    "file's metadata: "
                                    "steadydiff.load(FILE) and `steadydiff sample FILE` read "
                                    "it. --single-file FILE: export a full Stable Diffusion "
                                    "fine-tune (a run or "
                                    "checkpoint with model.pretrained and adapter.kind=none; "
                                    "EMA weights by default) or a diffusers SD folder as a "
                                    "single-file checkpoint: model.diffusion_model.*, "
                                    "first_stage_model.*, cond_stage_model.*. A run from a "
                                    "single file keeps that file's VAE and text encoder "
                                    "tensors as they were. Non-finite weights are refused; "
                                    "the file is written atomically. Neither: a Stable "
                                    "Diffusion LoRA or hypernetwork run's numbered files "
                                    "(RUN/lora/<run>-step00001000.safetensors, pytorch_lora_"
                                    "weights-step00001000.safetensors) of the checkpoint "
                                    "--step N (or SOURCE, a checkpoint), written as training "
                                    "writes them; files already there are kept.")
    xp.add_argument("source", help="run directory, checkpoint, or diffusers SD folder")
    which = xp.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, metavar="N",
                       help="the run's kept checkpoint of step N (or the best evaluation's) "
                            "instead of the newest")
    which.add_argument("--checkpoint", default=None, metavar="CKPT",
                       help="this checkpoint of the run: a directory, or its name under "
                            "RUN/checkpoints (step_00001000, best/step_00001000)")
    what = xp.add_mutually_exclusive_group()
    what.add_argument("--out", metavar="OUT.safetensors",
                      help="the file to write: steadydiff's own model as one file, or a "
                           "Stable Diffusion fine-tune (or diffusers folder) as one "
                           "original-layout file (see above)")
    what.add_argument("--single-file", metavar="OUT.safetensors",
                      help="the same as --out for a Stable Diffusion fine-tune (kept for "
                           "scripts)")
    xp.add_argument("--raw-weights", action="store_true",
                    help="use the raw model weights instead of the EMA")
    xp.add_argument("--base", default=None, metavar="PATH",
                    help="--single-file: the run's base model (model.pretrained), if it "
                         "moved since training (the identity the run recorded is checked)")
    xp.add_argument("--half", action="store_true",
                    help="write fp16 tensors (half the size; what most shared files use)")
    xp.add_argument("--force", action="store_true",
                    help="replace an existing output file (never a directory or the source)")

    cn = sub.add_parser("condition", formatter_class=_Formatter,
                        help="make ControlNet conditioning images (Canny edges, gray, tile) "
                             "from a folder of images",
                        description="Write one conditioning image per image of DATA (OpenCV, "
                                    "no network weights) under the same relative path in "
                                    "--out, as PNG, with conditioning.json recording the kind "
                                    "and parameters (a run over the folder records it). "
                                    "DATA/conditioning is where data.conditioning=folder "
                                    "looks. Existing files are never replaced (--force: only "
                                    "those an earlier run of this command wrote). See "
                                    "docs/controlnet.md.")
    cn.add_argument("data", help="the image folder (searched recursively)")
    cn.add_argument("--kind", required=True, choices=CONDITION_KINDS,
                    help="canny: edges with double thresholds; gray: luminance; tile: a "
                         "blurred downscale")
    cn.add_argument("--out", default=None, help="output folder (default: DATA/conditioning)")
    cn.add_argument("--low", type=float, default=None,
                    help="canny: the lower hysteresis threshold (default 100)")
    cn.add_argument("--high", type=float, default=None,
                    help="canny: the upper hysteresis threshold (default 200)")
    cn.add_argument("--aperture", type=int, default=None,
                    help="canny: Sobel kernel side, 3, 5 or 7 (default 3)")
    cn.add_argument("--l2", action="store_const", const=True, default=None,
                    help="canny: the exact L2 gradient magnitude (default: L1)")
    cn.add_argument("--blur", type=int, default=None,
                    help="canny: Gaussian blur kernel side before the edges, odd; 0: none "
                         "(default 0)")
    cn.add_argument("--factor", type=int, default=None,
                    help="tile: how much the image is shrunk before enlarging it back "
                         "(default 8)")
    cn.add_argument("--force", action="store_true",
                    help="replace the files an earlier `steadydiff condition` wrote in --out "
                         "(never anything else)")

    li = sub.add_parser("lint", formatter_class=_Formatter,
                        help="warn about dangerous-but-legal settings in a config, quickly",
                        description="Validate CONFIG (with --set) and print the start-up "
                                    "lint's warnings (an LR far above the family's, fp16 "
                                    "attention without QK-norm, an EMA that cannot warm up, "
                                    "...): what `steadydiff train` prints at start, without "
                                    "building anything. `train --dry-run` also builds the "
                                    "model and reads the data. Exit 0 even with warnings "
                                    "(--strict: 1), 2 for a config that does not load.")
    li.add_argument("config", help="YAML config file")
    li.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    li.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")

    it = sub.add_parser("init", formatter_class=_Formatter,
                        help="write a commented starting config for a task",
                        description="Write the config a task starts from: only the keys its "
                                    "users set, each commented (the rest keep their "
                                    "defaults; `steadydiff train FILE --dry-run "
                                    "--print-config` shows them all). Tasks: "
                                    + "; ".join(f"{t.name}: {t.what}" for t in _tasks()))
    it.add_argument("task", choices=[t.name for t in _tasks()], help="what to train")
    it.add_argument("--out", default=None,
                    help="the config file to write (default: ./TASK.yaml); an existing "
                         "file is refused without --force")
    it.add_argument("--force", action="store_true", help="replace an existing --out file")

    d = sub.add_parser("doctor", formatter_class=_Formatter,
                       help="post-mortem: name the likely causes of a run's trouble",
                       description="Examine a run directory or a checkpoint (weights, EMA, a "
                                   "probe forward pass, the run's incidents and metrics, the "
                                   "config) and list the likely causes, ranked, with evidence "
                                   "and recommendations.",
                       epilog="exit codes: 0 healthy or warnings only, 1 critical findings, "
                              "2 bad input (no such path, not a run or checkpoint)")
    d.add_argument("path", help="run directory (its newest intact checkpoint) or checkpoint "
                                "directory")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-probe", action="store_true",
                   help="skip the probe forward pass (weights and history only)")
    d.add_argument("--verbose", action="store_true", help="also list info findings")
    d.add_argument("--device", default="cpu", help="where the probe forward pass runs")
    return p


def _tasks():
    from .tasks import TASKS
    return TASKS


def cmd_lint(a: argparse.Namespace) -> int:
    from .config import load_config
    from .lint import lint

    cfg = load_config(a.config, a.overrides)
    found = lint(cfg)
    for msg in found:
        print(f"warning: {msg}")
    print(f"lint: {a.config}: {len(found)} warning{'s' * (len(found) != 1)}"
          + ("" if found else " (the device-dependent checks run at start: train --dry-run)"))
    return 1 if (found and a.strict) else EXIT_OK


def cmd_init(a: argparse.Namespace) -> int:
    from .tasks import get, template

    out = Path(a.out) if a.out else Path(f"{a.task}.yaml")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give the config file to write")
    if out.exists() and not a.force:
        raise ValueError(f"{out} exists; give another --out, or --force to replace it")
    text = template(a.task)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(f"# written by `steadydiff init {a.task}`: {get(a.task).what}\n" + text)
    os.replace(tmp, out)
    print(f"wrote {out} ({get(a.task).what}); edit the paths, then:\n"
          f"  steadydiff lint {out}\n  steadydiff train {out} --dry-run\n"
          f"  steadydiff train {out} --out runs/{out.stem}")
    return EXIT_OK


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    """`steadydiff eval`'s options (evaluate.run_cli reads them)."""
    p.add_argument("checkpoint", help="checkpoint or run directory")
    p.add_argument("--num", type=int, default=500,
                   help="samples to draw (compared with as many real images)")
    p.add_argument("--sampler", default=None, choices=SAMPLER_NAMES,
                   help="default: the checkpoint config's sample.sampler")
    p.add_argument("--steps", type=int, default=None, help="default: sample.steps")
    p.add_argument("--cfg-scale", type=float, default=None, help="default: sample.cfg_scale")
    p.add_argument("--seed", type=int, default=0, help="sampling and subset seed")
    p.add_argument("-k", type=int, default=3, help="nearest neighbours for precision/recall")
    p.add_argument("--inception-weights", default=None, metavar="PATH",
                   help="also report true FID with the standard FID InceptionV3 weights from "
                        "this local file (pt_inception-2015-12-05-*.pth; never downloaded)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: auto)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    p.add_argument("--out", default=None, help="also write the figures to this JSON file")


def cmd_condition(a: argparse.Namespace) -> int:
    from .data import DataError
    from .data.conditioning import make_conditioning

    params = {k: getattr(a, k) for k in ("low", "high", "aperture", "l2", "blur", "factor")
              if getattr(a, k) is not None}
    try:
        rep = make_conditioning(a.data, a.out, a.kind, params, force=a.force,
                                say=lambda s: print(s, file=sys.stderr))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    shown = ", ".join(f"{k}={v}" for k, v in rep.recipe["params"].items()) or "no parameters"
    print(f"condition: {len(rep.written)} {a.kind} maps ({shown}) written to {rep.out} in "
          f"{rep.seconds:.1f} s; recipe in {rep.out / 'conditioning.json'}")
    for path, why in list(rep.skipped.items())[:5]:
        print(f"  skipped {path}: {why}")
    if len(rep.skipped) > 5:
        print(f"  ... and {len(rep.skipped) - 5} more skipped")
    return EXIT_OK


def cmd_eval(a: argparse.Namespace) -> int:
    from .eval.evaluate import run_cli
    res = run_cli(a)
    return 1 if res.get("error") else EXIT_OK  # 1: nothing (or not all) could be measured


def cmd_train(a: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .trainer.loop import run

    if a.resume and a.no_resume:
        raise ConfigError(f"--resume {a.resume} and --no-resume contradict each other: "
                          "pass one (--resume continues from that checkpoint, --no-resume "
                          "starts fresh)")
    cfg = load_config(a.config, a.overrides)
    if a.dry_run:
        from .devices import resolve_device
        from .lint import lint_report
        from .preflight import check, resolve, resolve_data, resolve_epochs
        from .preflight import text_model as preflight_text_model
        from .trainer import speed

        if a.grow_resolution:  # the config the grown run would train with
            cfg = _grown_config(cfg, a)
        cfg, notes = resolve(cfg)  # what an SD folder's scheduler decides
        for note in notes:
            print(f"stable diffusion: {note}", file=sys.stderr)
        cfg, notes = resolve_data(cfg)  # a kohya dataset TOML's resolution and batch
        for note in notes:
            print(f"data: {note}", file=sys.stderr)
        device = resolve_device(cfg.train.device, what="train.device")
        cfg, chosen = speed.resolve(cfg, device)  # the `auto` speed settings, as a run would

        # what a run checks before its first step: fails the same way
        pre = check(cfg, device=device)
        if preflight_text_model(cfg):  # the caption-length check the run makes at its start
            from .integrations.sd.setup import caption_length_warning

            warn = caption_length_warning(cfg, pre.data)
            if warn:
                print(f"warning: {warn}", file=sys.stderr)
        cfg, lines = resolve_epochs(cfg, pre.data)  # train.epochs -> steps; kohya subsets
        print("".join(f"{line}\n" for line in lines), end="", file=sys.stderr)
        print(_config_text(cfg, whole=a.print_config), end="")
        # stdout stays valid YAML: the summary is a comment
        print("".join(f"# {line}\n" for line in ["dry run: ok", *pre.header(cfg),
                                                   *([speed.describe(chosen, device)]
                                                     if chosen else [])]), end="")
        # stderr, like the trainer's own warnings
        print(lint_report(cfg, pre.device), end="", file=sys.stderr)
        return EXIT_OK
    out = Path(a.out) if a.out else Path("runs") / Path(a.config).stem
    resume = a.resume if a.resume else (not a.no_resume)
    say = print if int(os.environ.get("RANK", 0)) == 0 else (lambda *_a, **_k: None)
    if a.print_config:
        say(_config_text(cfg, whole=True), end="")
    res = run(cfg, run_dir=out, resume=resume, allow_config_change=a.allow_config_change,
              restart=a.restart, grow_resolution=a.grow_resolution)
    if say is not print:  # torchrun: rank 0 reports for the group
        return EXIT_OK
    print(f"\nfinished {res.steps} steps in {res.seconds:.0f}s"
          + (f", final loss {res.final_loss:.4f}" if res.final_loss is not None else ""))
    print(f"  checkpoint: {res.checkpoint}")
    if res.samples:
        print(f"  samples:    {res.samples[-1]}")
    print(f"  metrics:    {out / 'metrics.jsonl'}")
    if cfg.model.pretrained:  # what to load where: the LoRA files, the base, the rank
        from .integrations.sd.advice import load_hints

        for line in load_hints(cfg, out):
            print(f"  {line}")
    return EXIT_OK


def _config_text(cfg, whole: bool) -> str:
    """The config as YAML, what differs from the defaults first: the changed keys as a
    config of their own (``whole``: then every key, as comments name the differences)."""
    diff = cfg.differences()
    if not whole:
        return (f"# the {len(diff)} keys that differ from the defaults (a config holding only "
                f"these is this run's); --print-config shows every key\n"
                + cfg.changed_yaml())
    lines = [f"# {key}: {value!r} (default {default!r})" for key, value, default in diff]
    return ("# differs from the defaults:\n" + "".join(f"{ln}\n" for ln in lines)
            + "# the whole resolved config:\n" + cfg.to_yaml())


def _grown_config(cfg, a: argparse.Namespace):
    """--dry-run --grow-resolution: the config at the new size against the checkpoint the
    run would continue (its attention levels by depth, or the error the run would give)."""
    from .config import ConfigError
    from .rundir import RunDir
    from .trainer import checkpoint as ckpt
    from .trainer.resolution import grow_from_checkpoint

    out = Path(a.out) if a.out else Path("runs") / Path(a.config).stem
    source = ckpt.resolve_checkpoint(a.resume) if a.resume else RunDir(out).latest_good()
    if source is None:
        raise ConfigError(f"--grow-resolution continues a run at a larger data.image_size, "
                          f"but {out} has no checkpoint to continue")
    cfg, notes = grow_from_checkpoint(cfg, source)
    for note in notes:
        print(f"# grow resolution: {note}", file=sys.stderr)
    return cfg


def cmd_sample(a: argparse.Namespace) -> int:
    from .loading import load
    from .eval.grid import grid_nrow, save_grid, save_npz

    from .files import check_output

    out = Path(a.out)
    if out.suffix.lower() not in (".png", ".npz"):
        raise ValueError(f"--out must end in .png or .npz, got {out}")
    check_output(out, force=a.force, inputs=[a.checkpoint, *(a.lora or [])])
    for name, v in (("--steps", a.steps), ("--num", a.num)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    pipe = load(a.checkpoint, device=a.device, use_ema=not a.raw_weights,
                adapter_scale=a.adapter_scale, base=a.base)
    for item in a.lora or []:
        path, _, scale = item.rpartition(":") if re.search(r":[-+.\d]+$", item) \
            else (item, "", "1")
        pipe.load_lora(path, float(scale))
    prompt = a.prompt[0] if a.prompt and len(a.prompt) == 1 else a.prompt
    x, y = pipe.sample(a.num, sampler=a.sampler, steps=a.steps, class_label=a.class_label,
                       cfg_scale=a.cfg_scale, eta=a.eta, seed=a.seed, prompt=prompt,
                       negative_prompt=a.negative_prompt, control_image=a.control_image,
                       control_scale=a.control_scale, control_start=a.control_start,
                       control_end=a.control_end, width=a.width, height=a.height)
    if out.suffix.lower() == ".npz":
        save_npz(x, out, y)
    else:
        by_class = pipe.num_classes if a.class_label is None else 0
        save_grid(x, out, nrow=grid_nrow(x.shape[0], by_class))
    print(f"wrote {x.shape[0]} samples from {pipe.checkpoint} (step {pipe.step}) to {out}")
    return EXIT_OK


def cmd_ema(a: argparse.Namespace) -> int:
    from . import posthoc

    if a.sweep == (a.sigma_rel is not None):
        raise ValueError("pass --sigma-rel S (reconstruct one EMA) or --sweep (evaluate "
                         "several and mark the best), not " + ("both" if a.sweep else "neither"))
    if not a.sweep:
        if a.sigma_rels is not None:
            raise ValueError("--sigma-rels goes with --sweep; for one EMA pass --sigma-rel")
        path, rec = posthoc.reconstruct_to(a.run_dir, a.sigma_rel, a.out, force=a.force)
        print(f"wrote the post-hoc EMA sigma_rel={a.sigma_rel:g} (gamma {rec['gamma']:.2f}, "
              f"{rec['snapshots']} snapshots, kernel fit residual {rec['residual']:.2g}) to "
              f"{path}")
        for why in rec["skipped"]:
            print(f"  skipped {why}")
        return EXIT_OK
    if a.out is not None:
        raise ValueError("--sweep writes RUN/checkpoints/posthoc_best; --out goes with "
                         "--sigma-rel")
    if a.num < 8:
        raise ValueError(f"--num must be at least 8, got {a.num}")
    try:
        rels = (posthoc.DEFAULT_SWEEP if a.sigma_rels is None
                else [float(v) for v in a.sigma_rels.split(",") if v.strip()])
    except ValueError:
        raise ValueError(f"--sigma-rels must be comma-separated numbers, got "
                         f"{a.sigma_rels!r}") from None
    res = posthoc.sweep(a.run_dir, rels, num=a.num, sampler=a.sampler, steps=a.steps,
                        seed=a.seed, device=a.device, force=a.force)
    print(posthoc.sweep_markdown(res), end="")
    print(f"wrote {', '.join(res['files'].values())}")
    return EXIT_OK


def cmd_merge(a: argparse.Namespace) -> int:
    from .adapters import merge_checkpoint

    path = merge_checkpoint(a.checkpoint, a.out, scale=a.scale, base=a.base)
    print(f"wrote merged checkpoint {path} (adapter scale {a.scale:g})")
    return EXIT_OK


def cmd_export(a: argparse.Namespace) -> int:
    import torch

    dtype = torch.float16 if a.half else None
    if a.checkpoint:  # a name under RUN/checkpoints, or a path
        named = Path(a.source) / "checkpoints" / a.checkpoint
        a.source = named if named.is_dir() else Path(a.checkpoint)
        if not Path(a.source).is_dir():
            raise ValueError(f"--checkpoint {a.checkpoint}: neither {named} nor "
                             f"{a.checkpoint} is a checkpoint directory")
    if not a.out and not a.single_file:  # an SD adapter run's numbered files
        from .integrations.sd.export import export_adapter

        if a.half:
            raise ValueError("--half casts --out/--single-file files; LoRA files keep the "
                             "run's fp32 tensors: drop --half")
        written, left = export_adapter(a.source, a.step,
                                       use_ema=False if a.raw_weights else None)
        for p in written:
            print(f"wrote {p}")
        for p in left:
            print(f"kept {p} (already there)")
        return EXIT_OK
    if a.step is not None:
        from .integrations.sd.export import checkpoint_at

        a.source = checkpoint_at(a.source, a.step)
    if a.out and _stable_diffusion_source(a.source):  # --out: the file this command writes
        a.single_file, a.out = a.out, None
    if a.out:
        from .loading import export_model

        path = export_model(a.source, a.out, use_ema=not a.raw_weights, dtype=dtype,
                            force=a.force)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, "
              f"{'raw' if a.raw_weights else 'EMA'} weights; steadydiff.load reads it)")
        return EXIT_OK
    from .integrations.sd.export import export

    path = export(a.source, a.single_file, use_ema=not a.raw_weights, dtype=dtype,
                  force=a.force, base=a.base)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, original single-file "
          "layout)")
    return EXIT_OK


def _stable_diffusion_source(source: str | Path) -> bool:
    """Whether ``export SOURCE --out`` writes a Stable Diffusion single file: a diffusers
    folder, or a run / checkpoint whose config names ``model.pretrained`` (its state.json
    read, no weights)."""
    from .trainer import checkpoint as ckpt

    p = Path(source)
    if (p / "model_index.json").is_file():
        return True
    try:
        state = json.loads((ckpt.resolve_checkpoint(p) / "state.json").read_text())
    except (OSError, ValueError, RuntimeError):
        return False  # export names what is wrong with it
    return bool(((state.get("config") or {}).get("model") or {}).get("pretrained"))


def cmd_report(a: argparse.Namespace) -> int:
    from .report import write_report

    path = write_report(a.run_dir, a.out)
    print(f"wrote {path}")
    return EXIT_OK


def cmd_doctor(a: argparse.Namespace) -> int:
    from .doctor import diagnose, format_diagnosis

    d = diagnose(a.path, probe=not a.no_probe, device=a.device)
    if a.json:
        print(json.dumps(d.to_dict(), indent=1))
    else:
        print(format_diagnosis(d, verbose=a.verbose), end="")
    return d.exit_code  # 0 healthy / warnings only, 1 critical findings


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(_one_value_per_set(sys.argv[1:] if argv is None else argv))
    from . import quiet

    quiet.install()  # third-party notices off the console (kept in RUN/third_party.log)
    handlers = {"train": cmd_train, "sample": cmd_sample, "eval": cmd_eval, "ema": cmd_ema,
                "condition": cmd_condition,
                "report": cmd_report, "doctor": cmd_doctor, "merge": cmd_merge,
                "export": cmd_export, "lint": cmd_lint, "init": cmd_init}
    try:
        return handlers[args.command](args)
    except Exception as e:  # noqa: BLE001 (each known kind is an exit code; others re-raise)
        return _exit_for(e)
    except KeyboardInterrupt:  # Ctrl-C outside training (the trainer handles its own)
        print("\ninterrupted", file=sys.stderr)
        return 130


def _exit_for(e: Exception) -> int:
    """The exit code (and message) of an exception a command raised; others re-raise.

    The exception classes are imported here, not at start: they import torch (seconds),
    which --help, --version, lint and init never need; when one of them was raised, its
    module is already loaded."""
    if isinstance(e, (ValueError, FileNotFoundError)):  # ConfigError, DataError: bad input
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from .distributed import EXIT_DIST_FAILURE, DistributedError
    from .guard import GuardAbort
    from .rundir import RunDirError
    from .trainer.checkpoint import CheckpointError
    from .trainer.loop import CheckpointSaveError
    from .trainer.preempt import TrainingInterrupted

    if isinstance(e, (CheckpointError, RunDirError)):
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if isinstance(e, GuardAbort):
        print(f"aborted: {e}", file=sys.stderr)
        point = getattr(e, "abort_point", None)  # set by the trainer (rank 0)
        if point:
            where = (f"from the abort point {point['checkpoint']}" if point["checkpoint"]
                     else "from the newest checkpoint" if point.get("checkpoint_step")
                     is not None else "(no checkpoint or verified state to resume from: "
                     "it starts again)")
            print(f"to resume {where} with the LR the guard found safe ({point['lr_why']}):"
                  f"\n  {point['resume']}", file=sys.stderr)
        return EXIT_ABORTED
    if isinstance(e, CheckpointSaveError):
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SAVE_FAILED
    from .files import WriteFailed, describe_failure, write_failure

    if isinstance(e, WriteFailed) or write_failure(e) is not None:
        # a full disk while writing anything: a sentence, not a traceback
        where = getattr(e, "filename", None) or "an output"
        print(f"error: {e if isinstance(e, WriteFailed) else describe_failure(where, e)}",
              file=sys.stderr)
        return EXIT_SAVE_FAILED
    if isinstance(e, DistributedError):
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DIST_FAILURE
    if isinstance(e, TrainingInterrupted):
        if "LOCAL_RANK" in os.environ:  # torchrun: rank 0 speaks for the group
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"\n{e}\nto resume, run the same torchrun command again",
                      file=sys.stderr)
        else:
            print(f"\n{e}\nto resume, run the same command again:\n  "
                  + " ".join(_command_line()), file=sys.stderr)
        return EXIT_INTERRUPTED
    raise e


_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def _one_value_per_set(argv: list) -> list[str]:
    """``--set a=1 b=2 CONFIG`` as ``--set a=1 --set b=2 CONFIG``: the values after one
    ``--set`` are the KEY=VALUE words that follow it, so a positional (the config path)
    placed after them is never taken for an override, as argparse's ``nargs="+"`` would."""
    out: list[str] = []
    taking = False
    for word in map(str, argv):
        if word == "--set":
            taking = False
            out.append(word)
            continue
        if out and out[-1] == "--set":
            out.append(word)  # the first value: whatever it is (argparse names a bad one)
            taking = True
            continue
        if taking and _OVERRIDE.match(word):
            out += ["--set", word]
            continue
        taking = False
        out.append(word)
    return out


def _command_line() -> list[str]:
    """This process's command line, as a user would retype it."""
    import shlex

    argv = list(sys.argv)
    if argv and argv[0].endswith(("cli.py", "__main__.py")):
        argv = ["python", "-m", "steadydiff"] + argv[1:]
    return [shlex.quote(a) for a in argv]


if __name__ == "__main__":
    sys.exit(main())
