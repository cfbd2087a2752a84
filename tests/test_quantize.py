"""model.quantize_base=int8 (integrations/quantize.py): a LoRA over a frozen FLUX.1 base
stored in 8 bits with bf16 compute — the base's Linear weights really are int8 (and take
about half of bf16's bytes), the model's output stays close to the bf16 base's, the run
trains, resumes exactly and samples; refused with the reason where it cannot run."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_flow_families import _build, flow_config  # noqa: E402
from test_sd import shapes  # noqa: E402

INT8 = ("model.quantize_base=int8", "train.precision=bf16", "train.allow_slow_precision=true")


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from steadydiff.integrations.sd.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("q") / "flux", "flux")


def test_the_base_is_stored_in_int8_and_computes_close_to_bf16(flux, tmp_path):
    pytest.importorskip("torchao")
    from steadydiff.integrations.quantize import stored_bytes

    data = shapes(tmp_path / "i", 2)
    q, _, media = _build(flow_config(flux, data, "flux", *INT8))
    b, _, _ = _build(flow_config(flux, data, "flux", "train.precision=bf16",
                                 "train.allow_slow_precision=true"))
    qt, bt = q.denoiser, b.denoiser
    w = qt.transformer_blocks[0].attn.to_q.base_layer.weight
    assert type(w).__name__ == "Int8Tensor" and not w.requires_grad
    assert stored_bytes(qt) < 0.75 * stored_bytes(bt)  # int8 + row scales vs bf16
    trainable = [n for n, p in q.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in q.parameters() if p.requires_grad)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    y = media.encode_prompts(["a red square", "a blue circle"])
    t = torch.tensor([300.0, 800.0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        oq, ob = q(x, t, y).float(), b(x, t, y).float()
    rel = (oq - ob).norm() / ob.norm()
    assert 0 < rel < 0.05, rel  # quantized (not the same), and close


def test_a_lora_trains_on_the_int8_base_resumes_exactly_and_samples(flux, tmp_path, capsys):
    pytest.importorskip("torchao")
    data = shapes(tmp_path / "images")
    fixed = (*INT8, "optim.lr=0.01", f"data.cache_dir={tmp_path / 'c'}")
    straight = steadydiff.train(flow_config(flux, data, "flux", *fixed),
                                out_dir=tmp_path / "straight")
    assert "Linear layers stored in int8" in capsys.readouterr().out
    steadydiff.train(flow_config(flux, data, "flux", *fixed, "train.steps=2"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(flow_config(flux, data, "flux", *fixed),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model and a.model.keys() == b.model.keys()
    assert all("lora_" in k for k in a.model)  # the base is not in the checkpoint
    for k in a.model:
        assert torch.isfinite(a.model[k]).all()
        assert torch.equal(a.model[k], b.model[k]), k
    assert any(a.model[k].abs().sum() > 0 for k in a.model if "lora_B" in k)  # it learned
    run = steadydiff.load(tmp_path / "straight", device="cpu")  # over the released base
    x, _ = run.sample(prompt="a red square", steps=2, num=1)
    assert torch.isfinite(x).all()


def test_refused_with_the_reason_where_it_cannot_run(flux, tmp_path, monkeypatch):
    from steadydiff.integrations.quantize import check

    data = shapes(tmp_path / "i", 2)
    with pytest.raises(ConfigError, match="set train.precision=bf16"):
        flow_config(flux, data, "flux", "model.quantize_base=int8")
    with pytest.raises(ConfigError, match="adapter.kind=lora"):
        flow_config(flux, data, "flux", "model.quantize_base=int8", "adapter.kind=none",
                    "train.precision=bf16")
    with pytest.raises(ConfigError, match="model.quantize_base"):
        flow_config(flux, data, "flux", "model.quantize_base=int4")
    with pytest.raises(ConfigError, match="CPU or a CUDA GPU, not on mps"):
        check("int8", torch.device("mps"))
    monkeypatch.setitem(sys.modules, "torchao", None)  # not installed
    with pytest.raises(ConfigError, match=r"needs torchao \(pip install 'steadydiff\[quant\]'"):
        _build(flow_config(flux, data, "flux", *INT8))
    from steadydiff.preflight import check as preflight  # the dry run says so too

    with pytest.raises(ConfigError, match="needs torchao"):
        preflight(flow_config(flux, data, "flux", *INT8), device=torch.device("cpu"))
