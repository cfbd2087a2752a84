"""FSDP2 (``train.parallel=fsdp``) under torchrun on CPU ranks (gloo), end to end.

The same harness as tests/test_distributed.py: ``tests/ddp_worker.py`` runs steadydiff's CLI
and, before the process group goes, dumps what its rank holds (FSDP's shards gathered whole),
so the ranks and the runs can be compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_distributed import STEPS, agreed_run, launch, ranks, same, trained
from steadydiff.config import ConfigError, load_config
from steadydiff.trainer import checkpoint as ckpt

FSDP = ["train.parallel=fsdp"]


def losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def consolidated(c: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model and EMA, whole, read in this (group-less) process."""
    loaded = ckpt.load_checkpoint(c)
    return {**{f"model.{k}": v for k, v in loaded.model.items()},
            **{f"ema.{k}": v for k, v in loaded.ema.items()}}


def dumped(out: Path) -> dict[str, torch.Tensor]:
    """The weights and EMA rank 0 held at the end (no optimizer moments)."""
    return {k: v for k, v in ranks(out, 1)[0][0].items() if k.startswith(("model.", "ema."))}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> Path:
    """A clean two-rank FSDP run (the reference for the fault and resume tests)."""
    return trained(tmp_path_factory, "fsdp2", *FSDP, expect="sharding: FSDP2 over 2 rank(s)")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The same global batch in one plain process (no sharding)."""
    return trained(tmp_path_factory, "single", procs=1)


def test_fsdp_matches_one_process_and_checkpoints_are_sharded(fsdp2, single):
    a, b = losses(fsdp2), losses(single)
    assert len(a) == len(b) == STEPS
    assert a == pytest.approx(b, rel=1e-5)  # measured 1.3e-7 (DDP's: 1.1e-7)
    final = fsdp2 / "checkpoints" / f"step_{STEPS:08d}"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 2
    shards = sorted(f for f in manifest["files"] if f.endswith(".distcp"))
    assert [f.split("/")[1].split("_")[2] for f in shards] == ["0", "1"]  # one per rank
    assert ckpt.verify_checkpoint(final) == []
    # consolidated in one process without a group: the single run's weights, to rounding
    diff = max_diff(consolidated(final), consolidated(single / "checkpoints" / final.name))
    assert diff < 1e-5, diff  # measured 1.5e-6 after 8 steps (DDP's: 5.5e-7)
    # and every rank ended holding the same whole state (its shards gathered)
    (r0, r1), (s0, s1) = ranks(fsdp2)
    assert same(r0, r1) and s0["incidents"] == s1["incidents"] == []
    # what rank 0 held: about half of every tensor, the snapshots too
    mem = json.loads((fsdp2 / "summary.json").read_text())["sharded_memory"]
    full = sum(v.numel() * 4 for k, v in r0.items() if k.startswith("model."))
    assert mem["world_size"] == 2 and 0.3 < mem["weights_bytes"] / full < 0.7
    assert mem["optimizer_bytes"] >= 2 * mem["weights_bytes"]  # AdamW's two moments
    # each snapshot: its half of the weights, EMA and AdamW's two moments (~2x full, 4x
    # unsharded); a verified checkpoint adds one to the ring
    assert mem["snapshots_kept"] >= 1
    assert 0 < mem["snapshots_bytes"] < 3 * full * mem["snapshots_kept"]


def test_nan_on_one_ranks_shard_makes_every_rank_act_together(tmp_path, fsdp2):
    """NaN written into rank 1's shard of a weight (its local part only: rank 0's part is
    finite, so a local check would disagree), NaN in rank 1's gradient shard, a NaN pixel in
    rank 1's batch: every rank takes the same decision at the same step, and the run ends
    finite and consistent."""
    faults = json.dumps([{"kind": "nan_batch", "step": 2, "rank": 1},
                         {"kind": "param_nan", "step": 4, "rank": 1},
                         {"kind": "grad_nan", "step": 6, "rank": 1}])
    r0, s0, decisions = agreed_run(tmp_path, *FSDP, f"faults={faults}",
                                   "guard.snapshot_every=2")
    kinds = {k: (st, a) for st, k, a in decisions}
    assert kinds["bad_batch"] == (2, "drop_samples")
    assert kinds["nonfinite_params"][1] == "rollback"
    assert kinds["nonfinite_grad"] == (6, "skip")
    by_kind = {i["kind"]: i for i in s0["incidents"]}
    # the parameter is named although only rank 1's shard of it went bad
    assert len(by_kind["nonfinite_params"]["evidence"]["params"]) == 1  # that one weight
    assert all(torch.isfinite(v).all() for v in r0.values())
    assert s0["step"] == STEPS


def test_save_on_two_ranks_loads_on_three_and_on_one(tmp_path, fsdp2):
    """Reshard: the 2-rank checkpoint of step 4, resumed by 3 FSDP ranks and by one plain
    process, holds exactly the saved weights and EMA (nothing trained: steps=4)."""
    src = fsdp2 / "checkpoints" / "step_00000004"
    saved = consolidated(src)
    # 3 FSDP ranks; one process sharded over a group of one, its shards "offloaded" (to the
    # CPU it runs on: the offload path); one plain process
    for procs, extra in ((3, FSDP), (1, FSDP + ["train.fsdp_offload=true"]), (1, [])):
        out = tmp_path / f"p{procs}{'-'.join(extra)}"
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(src, out / "checkpoints" / src.name)
        shutil.copy(fsdp2 / "config.yaml", out / "config.yaml")
        rc, log = launch(out, *extra, "train.steps=4", procs=procs)
        assert rc == 0, log
        assert "resumed from" in log and "step_00000004" in log
        assert same(dumped(out), saved), (procs, extra)


def test_fsdp_config_refusals_name_the_way_out():
    for bad, needle in ((["train.precision=fp16"], "bf16 or fp32"),
                        (["data.caption_shuffle=true"], "data.caption_shuffle"),
                        (["adapter.kind=lora", "adapter.base=x.safetensors"], "ddp"),
                        (["eval.every=10"], "steadydiff eval"),
                        (["train.compile=true"], "train.compile")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, FSDP + bad)
    with pytest.raises(ConfigError, match="train.parallel=fsdp"):
        load_config(None, ["train.fsdp_offload=true"])


def test_a_sharded_checkpoint_without_its_metadata_is_skipped(tmp_path, fsdp2):
    """DCP's .metadata is what makes the shards readable: a checkpoint missing it (a rank 0
    that died before writing it, a partial copy) fails verification, and resume takes the
    previous one."""
    root = tmp_path / "checkpoints"
    shutil.copytree(fsdp2 / "checkpoints", root)
    newest = ckpt.list_checkpoints(root)[0]
    (newest / "dcp" / ".metadata").unlink()
    problems = ckpt.verify_checkpoint(newest)
    assert problems and ".metadata" in problems[0]
    assert ckpt.latest_good(root) == ckpt.list_checkpoints(root)[1]


@pytest.mark.slow
def test_kill_one_rank_mid_checkpoint_then_rerun_is_bit_exact(tmp_path, fsdp2):
    """Rank 1 dies after writing its shards of step 4, before the manifest: the checkpoint
    never appears, ``latest`` still names step 2, and the rerun resumes there and ends
    bit-identical to the run that was never killed (same world size, deterministic CPU)."""
    kill = json.dumps([{"kind": "kill", "step": 4, "rank": 1, "where": "in_checkpoint"}])
    rc, log = launch(tmp_path, *FSDP, f"faults={kill}")
    assert rc != 0
    root = tmp_path / "checkpoints"
    assert not (root / "step_00000004").exists()
    assert (root / "latest").read_text().strip() == "step_00000002"
    rc, log = launch(tmp_path, *FSDP)
    assert rc == 0, log
    assert "resumed from" in log and "step_00000002" in log
    assert same(ranks(tmp_path)[0][0], ranks(fsdp2)[0][0])  # weights, EMA, AdamW moments
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # swept


@pytest.mark.slow
def test_three_ranks_match_and_continue_a_two_rank_run(tmp_path, fsdp2, single):
    """Three FSDP ranks (uneven shards) train like one process; a run saved on 2 ranks
    continues on 3 to the end, matching the uninterrupted run to rounding."""
    rc, log = launch(tmp_path / "three", *FSDP, procs=3)
    assert rc == 0, log
    a, b = losses(tmp_path / "three"), losses(single)
    assert a == pytest.approx(b, rel=1e-5)
    out = tmp_path / "cont"
    (out / "checkpoints").mkdir(parents=True)
    src = fsdp2 / "checkpoints" / "step_00000004"
    shutil.copytree(src, out / "checkpoints" / src.name)
    shutil.copy(fsdp2 / "config.yaml", out / "config.yaml")
    rc, log = launch(out, *FSDP, procs=3)
    assert rc == 0, log
    assert "written by 2 process(es), this run has 3" in log
    assert max_diff(dumped(out), dumped(fsdp2)) < 1e-5


def test_export_a_sharded_run_as_one_file_and_sample_it(tmp_path, fsdp2):
    """`steadydiff export RUN --out FILE`: the sharded checkpoint consolidated in this
    process, the EMA weights in one safetensors file with the config; `steadydiff.load`
    samples from it exactly what it samples from the run."""
    import steadydiff
    from steadydiff.cli import main as cli

    out = tmp_path / "model.safetensors"
    assert cli(["export", str(fsdp2), "--out", str(out)]) == 0
    final = consolidated(fsdp2 / "checkpoints" / f"step_{STEPS:08d}")
    from safetensors.torch import load_file
    assert same(load_file(str(out)), {k[4:]: v for k, v in final.items() if k.startswith("ema.")})
    a, _ = steadydiff.load(out, device="cpu").sample(2, steps=3, seed=1)
    b, _ = steadydiff.load(fsdp2, device="cpu").sample(2, steps=3, seed=1)
    assert torch.equal(a, b)
    assert cli(["export", str(fsdp2), "--out", str(tmp_path / "model.pt")]) == 2
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.slow
def test_a_plain_checkpoint_continues_sharded(tmp_path, single):
    """A one-process run's checkpoint (one file per part) continued by 2 FSDP ranks: each
    rank takes its shards of the weights, EMA and AdamW moments (matched by position), and
    the continued run follows the plain one to rounding (wrong moments would not)."""
    out = tmp_path / "cont"
    (out / "checkpoints").mkdir(parents=True)
    src = single / "checkpoints" / "step_00000004"
    shutil.copytree(src, out / "checkpoints" / src.name)
    shutil.copy(single / "config.yaml", out / "config.yaml")
    rc, log = launch(out, *FSDP)
    assert rc == 0, log
    assert "resumed from" in log and "sharding: FSDP2 over 2 rank(s)" in log
    final = f"step_{STEPS:08d}"
    diff = max_diff(consolidated(out / "checkpoints" / final),
                    consolidated(single / "checkpoints" / final))
    assert diff < 1e-5, diff


SD_BASE = ["data.image_size=32", "train.steps=4", "train.batch_size=4",
           "train.precision=fp32", "train.checkpoint_every=2", "train.sample_every=0",
           "train.device=cpu", "sample.num=2", "sample.steps=2", "optim.warmup_steps=0",
           "optim.lr=0.01", "logging.log_every=1", "logging.report=false",
           "logging.progress=false", "guard.warmup_steps=0", "data.num_workers=0",
           "adapter.kind=none", "train.dist_timeout=60", 'sample.prompts=["a red square"]']


@pytest.mark.slow  # two runs of the tiny SD UNet: ~90 s
def test_stable_diffusion_full_fine_tune_sharded(tmp_path, tiny_sd):
    """A Stable Diffusion UNet (diffusers) sharded by its down/up blocks over 2 ranks: it
    trains like one process and its guard decides like one process's, the validation prompt
    renders (every rank samples, rank 0 writes), and the final export is the diffusers
    folder of the whole trained UNet."""
    from diffusers import UNet2DConditionModel
    from test_sd import shapes

    data = shapes(tmp_path / "images")
    base = SD_BASE + [f"model.pretrained={tiny_sd}", f"data.path={data}"]
    sd_cfg = Path(__file__).resolve().parents[1] / "configs" / "sd_lora.yaml"
    rc, log = launch(tmp_path / "fsdp", *FSDP, config=sd_cfg, base=base)
    assert rc == 0, log
    assert "sharding: FSDP2 over 2 rank(s)" in log
    rc, log = launch(tmp_path / "one", procs=1, config=sd_cfg, base=base)
    assert rc == 0, log
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    final = "checkpoints/step_00000004"
    diff = max_diff(consolidated(tmp_path / "fsdp" / final),
                    consolidated(tmp_path / "one" / final))
    # measured 1.7e-4: AdamW normalises each element's step, so a rounding-size difference
    # in a near-zero gradient moves that weight by up to lr (0.01) a step
    assert diff < 1e-3, diff
    # the sharded guard took the one-process guard's decisions (the spike detector has no
    # warm-up here: skips, then rollbacks through the sharded snapshots)
    decisions = [[(i["step"], i["kind"], i["action"]) for i in map(json.loads, (
        tmp_path / run / "incidents.jsonl").read_text().splitlines())] for run in ("fsdp", "one")]
    assert decisions[0] == decisions[1] and ("rollback" in {a for *_, a in decisions[0]})
    assert (tmp_path / "fsdp" / "samples" / "step_00000004.png").is_file()
    unet = UNet2DConditionModel.from_pretrained(tmp_path / "fsdp" / "model" / "unet")
    ema = consolidated(tmp_path / "fsdp" / final)
    assert all(torch.equal(p, ema[f"ema.unet.{n}"]) for n, p in unet.state_dict().items())


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> Path:
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


def test_a_diffusers_unet_is_sharded_by_its_outermost_blocks(tiny_sd):
    """No unit inside another (FSDP2 wraps bottom-up or not at all): a diffusers UNet's
    units are its down and up blocks and its mid block's resnets and attentions."""
    from diffusers import UNet2DConditionModel

    from steadydiff.sharding import shard_units

    unet = UNet2DConditionModel.from_pretrained(tiny_sd / "unet")
    units = shard_units(unet)
    expected = (list(unet.down_blocks) + list(unet.mid_block.attentions)
                + list(unet.mid_block.resnets) + list(unet.up_blocks))
    assert {id(u) for u in units} == {id(u) for u in expected}
    assert not any(a is not b and any(m is b for m in a.modules())
                   for a in units for b in units)
