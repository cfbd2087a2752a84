"""FSDP with meta-device initialisation (train.parallel=fsdp, a full fine-tune of a model
folder): the denoiser is built on the meta device (shapes, no storage), sharded, and each
rank reads only its own shards from the folder's safetensors, so no rank ever holds the
whole model (sharding.materialize, FullUNetWeights.materialize, folder.part_reader)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from steadydiff import sharding  # noqa: E402
from steadydiff.integrations.sd.folder import SDFolderError  # noqa: E402

from test_flow_families import _build, flow_config  # noqa: E402
from test_sd import shapes  # noqa: E402


@pytest.fixture(scope="module")
def flux(tmp_path_factory) -> Path:
    from steadydiff.integrations.sd.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("meta") / "flux", "flux")


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group (FSDP2 shards over a mesh of one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        sharding.forget_meshes()
        dist.destroy_process_group()


def test_the_denoiser_is_built_without_storage_and_read_after_sharding(flux, tmp_path, group):
    from diffusers import FluxTransformer2DModel
    from torch.distributed.tensor import DTensor

    cfg = flow_config(flux, shapes(tmp_path / "i", 2), "flux", "adapter.kind=none",
                      "train.parallel=fsdp")
    model, weights, media = _build(cfg)
    assert all(p.is_meta for p in model.denoiser.parameters())  # no bytes allocated
    assert not media.vae.encoder.conv_in.weight.is_meta  # the other parts as usual
    sharding.shard(model, torch.device("cpu"))
    assert all(isinstance(p, DTensor) and p.is_meta for p in model.denoiser.parameters())
    read = weights.materialize(model, torch.device("cpu"))
    ref = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    assert read == sum(p.numel() * 4 for p in ref.parameters())  # one rank: all of it
    for k, v in ref.state_dict().items():
        p = model.denoiser.state_dict()[k]
        assert torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, v), k


def test_a_folder_whose_weights_do_not_fit_its_config_is_named(flux, tmp_path, group):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(flux, bad)
    w = bad / "transformer" / "diffusion_pytorch_model.safetensors"
    sd = load_file(w)
    sd["proj_out.weight"] = sd["proj_out.weight"][:, :-1].contiguous()
    save_file(sd, w)
    model, weights, _ = _build(flow_config(bad, shapes(tmp_path / "i", 2), "flux",
                                           "adapter.kind=none", "train.parallel=fsdp"))
    sharding.shard(model, torch.device("cpu"))
    with pytest.raises(SDFolderError, match=r"proj_out.weight has shape \(16, 15\); the "
                                            r"config's model takes \(16, 16\)"):
        weights.materialize(model, torch.device("cpu"))


@pytest.mark.slow  # two 2-process runs and a 1-process run of the tiny FLUX: ~2 min
def test_two_ranks_match_one_process_and_each_read_half_the_weights(flux, tmp_path):
    """2 gloo ranks, FLUX.1 full fine-tune built on the meta device: the losses are one
    process's (the FSDP tolerance), and each rank read about half of the weights (its
    shards; the two halves add up to the model): neither held the whole transformer."""
    from test_distributed import launch, ranks
    from test_fsdp import SD_BASE, losses

    data = shapes(tmp_path / "images")
    base = [b for b in SD_BASE if not b.startswith("sample.prompts")] + [
        f"model.pretrained={flux}", f"data.path={data}", "train.num_threads=1",
        "train.gradient_checkpointing=false",
        # a quiet run (the guard's warm-up, a modest LR): this compares the sharded losses
        "guard.warmup_steps=4", "optim.lr=0.001"]
    cfg = Path(__file__).resolve().parents[1] / "configs" / "flux_lora.yaml"
    rc, log = launch(tmp_path / "fsdp", "train.parallel=fsdp", config=cfg, base=base)
    assert rc == 0, log
    assert "built on the meta device" in log
    rc, log = launch(tmp_path / "one", procs=1, config=cfg, base=base)
    assert rc == 0, log
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    whole = None
    got = []
    for s in ranks(tmp_path / "fsdp", 2)[1]:
        import re

        m = re.search(r"this rank read ([\d.]+) of the ([\d.]+) MiB", s["sharded"])
        got.append(float(m.group(1)))
        whole = float(m.group(2))
    assert all(g < 0.6 * whole for g in got) and sum(got) == pytest.approx(whole, abs=0.02)
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    assert one["sharded"] is None  # one plain process: the whole model, as before
