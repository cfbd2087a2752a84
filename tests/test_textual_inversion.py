"""Textual inversion (adapter.kind=embedding) on the tiny SD 1.x and SDXL folders: only the
new token's rows train, the files load in diffusers, A1111's keys, exact resume, sampling
with the token (docs/sd.md#textual-inversion)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError, load_config  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_sd import sd_dir, shapes  # noqa: E402,F401

ROWS = "embeddings.token_embedding.ti_rows"


def ti_config(sd, data, *sets: str):
    base = [f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
            "train.steps=4", "train.batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "sample.num=2", "sample.steps=2", "optim.warmup_steps=0",
            "optim.lr=0.05", "optim.schedule=constant", "logging.log_every=1",
            "guard.warmup_steps=0", "data.num_workers=0", "data.trigger=<sks>",
            "adapter.kind=textual_inversion", "adapter.token=<sks>", "adapter.init_token=a"]
    return load_config("configs/sd_textual_inversion.yaml", base + list(sets))


@pytest.fixture(scope="module")
def ti_run(sd_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("ti")
    data = shapes(tmp / "images")
    res = steadydiff.train(ti_config(sd_dir, data, "adapter.num_vectors=2",
                                     f"data.cache_dir={tmp / 'cache'}"), out_dir=tmp / "run")
    return tmp, data, res


def test_only_the_new_rows_change(ti_run, sd_dir):  # noqa: F811
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    tmp, _, res = ti_run
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    (name,) = c.model  # the checkpoint holds the rows alone
    assert name.startswith("text_encoder.") and name.endswith(ROWS)
    rows = c.model[name]
    assert rows.shape == (2, 32)
    te = CLIPTextModel.from_pretrained(sd_dir / "text_encoder")
    # the trained model: every frozen tensor bit-identical to the folder's
    pipe = steadydiff.load(tmp / "run", device="cpu")
    model = pipe.model
    unet = UNet2DConditionModel.from_pretrained(sd_dir / "unet")
    for n, p in unet.state_dict().items():
        assert torch.equal(model.unet.state_dict()[n], p), n
    mine = model.text_encoder.state_dict()
    for n, p in te.state_dict().items():
        assert torch.equal(mine[n], p), n
    (extra,) = set(mine) - set(te.state_dict())
    assert extra.endswith(ROWS)
    # the rows moved away from the init token's embedding
    from transformers import CLIPTokenizer
    tok = CLIPTokenizer.from_pretrained(sd_dir / "tokenizer")
    a = te.get_input_embeddings().weight[tok("a", add_special_tokens=False).input_ids[0]]
    assert (rows - a).abs().max() > 1e-4
    info = json.loads((res.checkpoint / "state.json").read_text())["adapter"]
    assert info["kind"] == "embedding" and info["num_vectors"] == 2
