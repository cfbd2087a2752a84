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


def test_a_single_file_base_is_read_shard_by_shard_too(flux, tmp_path, group):
    """FLUX.1 from one file in Black Forest Labs' layout (model.single_file_config for the
    other parts): the transformer is built on the meta device as from a folder, and each
    rank reads its rows out of the file's fused tensors (Family.file_reader)."""
    from diffusers import FluxTransformer2DModel
    from torch.distributed.tensor import DTensor

    from steadydiff.integrations.sd.single_file import export_single_file
    from steadydiff.integrations.sd.source import load_parts

    p = load_parts(flux)
    f = export_single_file(tmp_path / "flux1.safetensors", p.denoiser, p.vae, p.text_encoders)
    cfg = flow_config(f, shapes(tmp_path / "i", 2), "flux", "adapter.kind=none",
                      "train.parallel=fsdp", f"model.single_file_config={flux}")
    model, weights, media = _build(cfg)
    assert all(p.is_meta for p in model.denoiser.parameters())
    assert not media.vae.encoder.conv_in.weight.is_meta
    sharding.shard(model, torch.device("cpu"))
    read = weights.materialize(model, torch.device("cpu"))
    ref = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    assert read == sum(p.numel() * 4 for p in ref.parameters())
    for k, v in ref.state_dict().items():
        t = model.denoiser.state_dict()[k]
        assert torch.equal(t.full_tensor() if isinstance(t, DTensor) else t, v), k


@pytest.mark.parametrize("family", ["flux", "sd3", "zimage"])
def test_the_file_reader_reads_any_rows_of_every_tensor(tmp_path, family):
    """Every diffusers tensor, any rows [a, b): what a rank holding those rows reads from an
    original-layout file (fused qkv slices, FLUX's swapped adaLN halves, wrapping), equal to
    the whole tensor's rows; a file of another size is named before anything is read."""
    from safetensors.torch import load_file, save_file

    from steadydiff.integrations.sd.single_file import export_single_file
    from steadydiff.integrations.sd.source import load_parts
    from steadydiff.integrations.sd.tiny import make_tiny

    folder = make_tiny(tmp_path / family, family)
    p = load_parts(folder)
    f = export_single_file(tmp_path / "one.safetensors", p.denoiser, p.vae, p.text_encoders)
    sd = {k: v.float() for k, v in p.denoiser.state_dict().items()}
    shapes_ = {k: tuple(v.shape) for k, v in sd.items()}
    read = p.family.file_reader(f, p.denoiser.config, shapes_)
    g = torch.Generator().manual_seed(0)
    for k, v in sd.items():
        torch.testing.assert_close(read(k, None, None), v, rtol=0, atol=0)
        if v.ndim == 0:
            continue
        for _ in range(3):
            a = int(torch.randint(0, v.shape[0], (1,), generator=g))
            b = int(torch.randint(a + 1, v.shape[0] + 1, (1,), generator=g))
            assert torch.equal(read(k, a, b), v[a:b]), (k, a, b)
    bad = load_file(f)
    key = next(k for k in bad if bad[k].ndim == 2)
    bad[key] = bad[key][:-1].contiguous()
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(SDFolderError, match="has shape .*another size"):
        p.family.file_reader(tmp_path / "bad.safetensors", p.denoiser.config, shapes_)
