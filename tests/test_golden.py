"""Golden numbers of tiny deterministic full runs (diffusers' ``test_full_loop`` style).

Relative tests (resume == straight, guard == no guard) cannot see a change that moves both
sides alike: a new loss weighting, an off-by-one in the schedule, a sampler's update, the
data order. These train a tiny UNet or DiT for a few steps on CPU in fp32 through the real
trainer, then pin what came out: the loss of every step (metrics.jsonl), the final model and
EMA weights, and sample grids drawn from the saved run with ``steadydiff.load``.

The numbers were measured on today's code (CPU, fp32, one thread) by running this file
with each pinned value set to None and reading the failure messages; a failure shows the new
value. A deliberate change to the math re-pins them, and says so in its commit.
"""

from __future__ import annotations

import json

import pytest
import torch

import steadydiff
from steadydiff.config import load_config
from steadydiff.trainer import checkpoint as ckpt

from pinning import checksum, pin  # noqa: E402  (tests/pinning.py)
from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

RUN = TINY_MODEL + ["train.steps=5", "train.checkpoint_every=0", "train.device=cpu",
                    "train.ema_decay=0.5", "optim.lr=2e-3", "logging.log_every=1",
                    "logging.report=false", "sample.num=4", "sample.steps=3"]
DIT = ["model.kind=dit", "model.dit.depth=2", "model.dit.hidden_size=32",
       "model.dit.num_heads=2", "model.dit.patch_size=2"]
# the other branch of every diffusion/optim choice the defaults leave untested
VARIANT = ["diffusion.prediction=v", "diffusion.schedule=cosine",
           "diffusion.loss_weighting=min_snr", "diffusion.timestep_sampling=logit_normal",
           "optim.schedule=cosine", "optim.warmup_steps=2", "model.qk_norm=true"]
# the other objectives (docs/objectives.md): rectified flow with a shift, a density and a
# weighting; EDM's preconditioned DiT
FLOW = ["diffusion.objective=flow", "diffusion.flow.shift=2.0",
        "diffusion.timestep_sampling=logit_normal", "diffusion.loss_weighting=cosmap"]
EDM = ["diffusion.objective=edm"]
CASES = {"unet": [], "dit": DIT, "unet-v-cosine-minsnr": VARIANT, "unet-flow": FLOW,
         "dit-edm": DIT + EDM}


def train(tmp_path, case: str, guard: bool):
    """Train ``case`` into tmp_path/run; (run dir, RunResult, metrics rows)."""
    run = tmp_path / "run"
    res = steadydiff.train(load_config(None, RUN + CASES[case] + [f"guard.enabled={guard}"]),
                           out_dir=run)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return run, res, rows


@pytest.mark.parametrize("case", list(CASES))
def test_full_loop(tmp_path, case):
    want = GOLDEN[case]
    run, res, rows = train(tmp_path, case, guard=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and res.incidents == 0
    pin(f"{case}: loss of steps 1..5", [r["loss"] for r in rows], want["loss"])
    assert res.final_loss == rows[-1]["loss"]
    pin(f"{case}: grad norm of steps 1..5", [r["grad_norm"] for r in rows], want["grad_norm"])
    c = ckpt.load_checkpoint(res.checkpoint)
    pin(f"{case}: final model weights", checksum(c.model), want["model"])
    pin(f"{case}: final EMA weights", checksum(c.ema), want["ema"])
    x, y = grid(run)
    assert x.shape == (4, 1, 8, 8) and y.tolist() == [0, 1, 2, 3]
    pin(f"{case}: dpmpp_2m sample grid", checksum(x), want["grid"])


@pytest.mark.parametrize("case", list(CASES))
def test_guard_off_gives_the_same_run(tmp_path, case):
    """On a healthy run the guard only watches: its clipping is the bare loop's global clip
    and its update the same AdamW and EMA step, so guard.enabled=false is bit-identical."""
    a, res_a, rows_a = train(tmp_path / "on", case, guard=True)
    b, res_b, rows_b = train(tmp_path / "off", case, guard=False)
    for key in ("loss", "grad_norm", "grad_norm_clipped", "lr"):
        assert [r[key] for r in rows_a] == [r[key] for r in rows_b], key
    ca, cb = ckpt.load_checkpoint(res_a.checkpoint), ckpt.load_checkpoint(res_b.checkpoint)
    for k in ca.model:
        assert torch.equal(ca.model[k], cb.model[k]) and torch.equal(ca.ema[k], cb.ema[k]), k
    assert torch.equal(grid(a)[0], grid(b)[0])


def grid(run):
    return steadydiff.load(run, device="cpu").sample(4, seed=3)  # config: dpmpp_2m, 3 steps


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "euler", "dpmpp_2m"])
def test_samplers_on_a_trained_model(unet_run, sampler):
    """Every sampler's grid from one trained UNet, with classifier-free guidance (scale 2:
    the unconditional branch runs too) and, for DDIM, eta > 0 (its fresh noise)."""
    pipe = steadydiff.load(unet_run, device="cpu")
    x, _ = pipe.sample(4, sampler=sampler, steps=4, seed=5, cfg_scale=2.0,
                       eta=0.5 if sampler == "ddim" else None)
    pin(f"{sampler} grid", checksum(x), SAMPLER_GRIDS[sampler])


@pytest.mark.parametrize("objective, sampler", [("flow", "euler"), ("flow", "heun"),
                                                ("edm", "heun"), ("edm", "euler"),
                                                ("edm", "ddpm")])
def test_objective_samplers_on_a_trained_model(tmp_path_factory, objective, sampler):
    """The flow and EDM samplers' grids from a trained UNet of each objective, with
    classifier-free guidance (scale 2)."""
    run = _objective_run(tmp_path_factory, objective)
    x, _ = steadydiff.load(run, device="cpu").sample(4, sampler=sampler, steps=4, seed=5,
                                                     cfg_scale=2.0)
    pin(f"{objective} {sampler} grid", checksum(x), SAMPLER_GRIDS[f"{objective}-{sampler}"])


_RUNS: dict = {}


def _objective_run(factory, objective):
    if objective not in _RUNS:
        run = factory.mktemp(f"golden-{objective}") / "run"
        steadydiff.train(load_config(None, RUN + {"flow": FLOW, "edm": EDM}[objective]),
                         out_dir=run)
        _RUNS[objective] = run
    return _RUNS[objective]


@pytest.fixture(scope="module")
def unet_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("golden") / "run"
    steadydiff.train(load_config(None, RUN), out_dir=run)
    return run


# --------------------------------------------------------------------------- pinned values

GOLDEN = {
    "unet": {
        "loss": [1.1169915199279785, 0.9655515551567078, 0.9378294944763184,
                 0.8680840730667114, 0.9076526761054993],
        "grad_norm": [1.7758818864822388, 1.385738492012024, 0.9642971158027649,
                      1.8605656623840332, 1.172262191772461],
        "model": (334.1881895508268, 2771.2754976543947),
        "ema": (332.6715143875988, 2765.7615701462255),
        "grid": (4.740795756690204, 190.3004135740921),
    },
    "dit": {
        # step 1 equals the UNet's: both output exactly 0 at init (zero-initialised last
        # layer), so the first loss is the mean square of the step's noise draws alone
        "loss": [1.1169915199279785, 0.9648212194442749, 0.9401224255561829,
                 0.8841173052787781, 0.929139256477356],
        "grad_norm": [1.3521648645401, 1.0394378900527954, 0.897051215171814,
                      1.1609076261520386, 0.7603827118873596],
        "model": (0.741321479845162, 2794.687865945404),
        "ema": (-0.5584317761788586, 2785.6861706154104),
        "grid": (2.2070438666269183, 190.92334892135113),
    },
    "unet-v-cosine-minsnr": {
        "loss": [0.22992175817489624, 0.2836654782295227, 0.36232826113700867,
                 0.2775624990463257, 0.3763801157474518],
        "grad_norm": [0.3971433937549591, 0.37097984552383423, 0.665733277797699,
                      0.4760550558567047, 0.47620612382888794],
        "model": (388.87939524024296, 2820.3495768128178),
        "ema": (388.52464364566924, 2818.451586430109),
        "grid": (-20.25461822375655, 123.58824638277292),
    },
}
GOLDEN["unet-flow"] = {
    "loss": [1.7669236660003662, 1.7241696119308472, 1.6486449241638184, 1.6868956089019775,
             1.645764708518982],
    "grad_norm": [2.149595022201538, 2.2618024349212646, 2.5328140258789062,
                  2.1449942588806152, 2.141479015350342],
    "model": (324.5231034088938, 2764.945789185149),
    "ema": (323.7777511612872, 2760.582554144405),
    "grid": (-18.59928183630109, 155.91796465590596),
}
GOLDEN["dit-edm"] = {
    "loss": [1.8838310241699219, 1.917043924331665, 1.5158932209014893, 1.9408574104309082,
             1.3636304140090942],
    "grad_norm": [2.265070676803589, 2.1632819175720215, 1.9231617450714111,
                  3.0294642448425293, 1.2408076524734497],
    "model": (-5.906121043169994, 2794.601164996911),
    "ema": (-6.144867886339256, 2785.7426152409444),
    "grid": (-11.841772049869178, 45.805128878651885),
}
SAMPLER_GRIDS = {
    "flow-euler": (-24.79084289819002, 166.2929931357503),
    "flow-heun": (-25.001065600663424, 166.25216769054532),
    "edm-heun": (-26.20027341786772, 214.46789370384067),
    "edm-euler": (-21.28765318961814, 64.42425744561478),
    "edm-ddpm": (-21.127976693678647, 54.36751634487882),
    "ddpm": (-0.9187575378455222, 180.94098351011053),
    "ddim": (-5.16588785906788, 193.46262386033777),
    "euler": (-5.896757600829005, 194.60143306665123),
    "dpmpp_2m": (-5.903473609825596, 194.36766163050197),
}
