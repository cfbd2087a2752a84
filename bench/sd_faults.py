"""SD path: the guard's fault scenarios through the real trainer on Stable Diffusion parts.

Each scenario trains a peft LoRA over a tiny Stable Diffusion folder (built from configs by
``steadydiff.integrations.sd.tiny``; random weights, nothing downloaded) on 16 captioned
32x32 images, with one injected fault, and checks what the issue asks: the run finishes,
its checkpoint and its exported LoRA (``RUN/lora/pytorch_lora_weights.safetensors``) are
finite, and the incident names the injected cause (the module, the parameter or the file):

- ``nan_latents``: a NaN in one sample of a caption batch's latents (``nan_batch``);
- ``nan_latent_at_cache``: one image's latent is NaN from the fp16 VAE and from the fp32
  re-encode (an encoder wrapper injects it at caching: the trainer has no step there), so
  it is quarantined and named;
- ``fp16_overflow_cross_attn``: fp16, the first cross-attention (``...attn2``) overflows;
- ``loss_spike``: one step's loss x 1e8;
- ``weight_corrupt``: one LoRA weight becomes 1e36 between steps;
- ``transient_nan``: one module's output is NaN once (a flaky device: the rerun is clean,
  so the diagnosis is the mechanism: ``transient_fault``, finite when run again, action
  ``rerun``).

    python bench/sd_faults.py --json                 # every scenario, ~2-4 min on a CPU
    python bench/sd_faults.py --scenarios loss_spike --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import env_info, print_table  # noqa: E402

CROSS_ATTN = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2"
LORA_PARAM = ("unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q."
              "lora_B.default.weight")
FP16 = ["train.precision=fp16", "train.allow_slow_precision=true", "model.vae_precision=fp32"]
BAD_IMAGE = "img05.png"

# name -> (fault or None, extra config, the incident kind expected, what it must name)
SCENARIOS: dict[str, tuple[dict | None, list[str], str, str]] = {
    "nan_latents": ({"kind": "nan_batch", "step": "half"}, [], "bad_batch", "file"),
    "nan_latent_at_cache": (None, ["model.vae_precision=fp16"], "sample_quarantined",
                            BAD_IMAGE),
    "fp16_overflow_cross_attn": ({"kind": "fp16_overflow", "step": "half",
                                  "target": CROSS_ATTN}, FP16, "attention_upcast", CROSS_ATTN),
    "loss_spike": ({"kind": "loss_scale", "step": "half", "factor": 1e8}, [], "loss_spike",
                   "t_bucket"),
    "weight_corrupt": ({"kind": "weight_corrupt", "step": "half", "target": LORA_PARAM}, [],
                       "weight_jump", LORA_PARAM),
    # the rerun is finite: there is nothing left to replay, the mechanism is the diagnosis
    "transient_nan": ({"kind": "transient_nan", "step": "half", "target": CROSS_ATTN}, [],
                      "transient_fault", '"action": "rerun"'),
}


def images(root: Path, n: int = 16) -> Path:
    """``n`` 32x32 coloured squares and circles, each with a .txt caption."""
    colors = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220),
              "yellow": (230, 220, 30)}
    root.mkdir(parents=True, exist_ok=True)
    yy, xx = np.mgrid[:32, :32]
    for i in range(n):
        name = list(colors)[i % 4]
        shape = "square" if i % 2 == 0 else "circle"
        c = 10 + i % 12
        mask = ((abs(yy - c) < 8) & (abs(xx - 16) < 8) if shape == "square"
                else (yy - c) ** 2 + (xx - 16) ** 2 < 64)
        im = np.full((32, 32, 3), 245, np.uint8)
        im[mask] = colors[name]
        Image.fromarray(im).save(root / f"img{i:02d}.png")
        (root / f"img{i:02d}.txt").write_text(f"a {name} {shape}")
    return root


def poison_cache(bad_file: str):
    """Make the VAE's latent of ``bad_file`` NaN in every dtype (the scenario's injection);
    returns the undo."""
    from steadydiff.integrations.sd.model import TextToImage

    real = TextToImage.encode_images
    marker = np.asarray(Image.open(_root / bad_file).convert("RGB"), np.float32) / 127.5 - 1

    def encode(self, x, dtype=None):
        z = real(self, x, dtype)
        ref = torch.as_tensor(marker).permute(2, 0, 1).to(x.device)
        bad = ((x - ref).abs().flatten(1).amax(1) < 1e-3).to(z.device)
        z[bad] = float("nan")
        return z

    TextToImage.encode_images = encode
    return lambda: setattr(TextToImage, "encode_images", real)


_root = Path()


def run_case(name: str, sd: Path, data: Path, out: Path, steps: int) -> dict[str, Any]:
    import steadydiff
    from steadydiff.config import load_config
    from steadydiff.trainer import checkpoint as ckpt
    from safetensors.torch import load_file

    fault, extra, kind, names = SCENARIOS[name]
    faults = []
    if fault:
        f = dict(fault)
        f["step"] = steps // 2
        faults = [f]
    sets = [f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
            f"train.steps={steps}", "train.batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=0", "train.sample_every=0", "train.device=cpu",
            "train.num_threads=1", "optim.warmup_steps=0", "logging.progress=false",
            "adapter.rank=4", "adapter.alpha=4", "guard.warmup_steps=3", "sample.num=2",
            "sample.steps=2", f"data.cache_dir={out / 'cache'}" if name != "nan_latent_at_cache"
            else f"data.cache_dir={out / ('cache-' + name)}", f"faults={json.dumps(faults)}",
            *extra]
    cfg = load_config("configs/sd_lora.yaml", sets)
    run = out / name
    undo = poison_cache(BAD_IMAGE) if name == "nan_latent_at_cache" else None
    t0 = time.perf_counter()
    error = None
    try:
        res = steadydiff.train(cfg, out_dir=run)
    except Exception as e:  # a scenario that crashes is a row, not the end of the bench
        res, error = None, f"{type(e).__name__}: {e}"
    finally:
        if undo:
            undo()
    row: dict[str, Any] = {"scenario": name, "fault": faults[0] if faults else "cache NaN",
                           "seconds": time.perf_counter() - t0, "error": error}
    rows = [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()] \
        if (run / "incidents.jsonl").exists() else []
    row["incidents"] = [(r["step"], r["kind"], r["action"]) for r in rows]
    hits = [r for r in rows if r["kind"] == kind]
    text = json.dumps(hits[0]) if hits else ""
    row["named"] = (names if names not in ("file", "t_bucket") else
                    ("an image file" if ".png" in text else "") if names == "file" else
                    f"t-bucket {hits[0]['evidence'].get('t_bucket')}" if hits else "")
    row["cause_named"] = bool(hits) and (names in text if names not in ("file", "t_bucket")
                                         else ".png" in text if names == "file"
                                         else "t_bucket" in hits[0]["evidence"])
    row["finished"] = res is not None and res.steps == steps
    finite = False
    if res is not None and res.checkpoint is not None:
        c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
        lora = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
        finite = all(bool(torch.isfinite(v).all()) for v in [*c.model.values(),
                                                              *lora.values()])
    row["finite"] = finite
    row["ok"] = row["finished"] and finite and row["cause_named"]
    return row


def main(argv: list[str] | None = None) -> int:
    global _root
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--steps", type=int, default=10, help="steps per run (the fault at half)")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the JSON result line")
    a = p.parse_args(argv)
    names = [s for s in a.scenarios.split(",") if s]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        p.error(f"unknown scenarios {unknown}; valid: {', '.join(SCENARIOS)}")
    if a.steps < 4:
        p.error("--steps must be at least 4 (the guard warms up for 3)")
    torch.set_num_threads(1)
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    out = Path(a.out or tempfile.mkdtemp(prefix="sd-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    sd = out / "tiny-sd"
    if not sd.exists():
        make_tiny_sd(sd, image_size=32)
    _root = images(out / "images")
    t0 = time.perf_counter()
    rows = [run_case(n, sd, _root, out, a.steps) for n in names]
    print_table([[r["scenario"], "yes" if r["finished"] else "no",
                  "yes" if r["finite"] else "no", "yes" if r["cause_named"] else "no",
                  r["named"][:60], " ".join(f"{s}:{k}/{act}" for s, k, act in r["incidents"])
                  [:80], f"{r['seconds']:.0f}", (r["error"] or "")[:40]] for r in rows],
                ["scenario", "finished", "finite", "cause named", "named", "incidents",
                 "s", "error"])
    result = {"bench": "sd_faults", "steps": a.steps, "scenarios": rows,
              "all_ok": all(r["ok"] for r in rows), "wall_seconds": time.perf_counter() - t0,
              **env_info()}
    if a.json:
        print(json.dumps(result))
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
