"""Memory savers for big models (train.gradient_checkpointing): the blocks' activations are
recomputed in the backward pass instead of kept, so far fewer bytes are saved for the
backward, and the gradients are those of the plain model (dropout included); on the Stable
Diffusion path through diffusers' and transformers' own switches, the text encoder's LoRA
still getting its gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch

import steadydiff
from steadydiff.config import load_config
from steadydiff.models import build_model, enable_checkpointing
from steadydiff.models.layers import Checkpointable
from steadydiff.trainer import checkpoint as ckpt

from tiny import TINY_MODEL


@contextlib.contextmanager
def saved_bytes():
    """The bytes autograd keeps for the backward while the block runs (out[0])."""
    out = [0]

    def pack(t):
        out[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


def _grads(model, x, t, y):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # dropout draws
    with saved_bytes() as kept:
        loss = model(x, t, y).square().mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, kept[0]


@pytest.mark.parametrize("kind", ["unet", "dit"])
def test_checkpointed_blocks_give_the_same_gradients_keeping_less(kind):
    sets = TINY_MODEL + ["model.unet.dropout=0.3"] if kind == "unet" else [
        "data.image_size=8", "model.kind=dit", "model.num_classes=10", "model.dit.depth=3",
        "model.dit.hidden_size=32", "model.dit.num_heads=2", "model.dit.patch_size=2"]
    cfg = load_config(None, sets)
    torch.manual_seed(0)
    model = build_model(cfg.model, image_size=8, channels=1).train()
    for p in model.parameters():  # the zero-initialised outputs would hide the blocks
        torch.nn.init.normal_(p, std=0.2)
    x, t, y = torch.randn(4, 1, 8, 8), torch.tensor([3., 40., 70., 99.]), torch.arange(4)
    plain, kept_plain = _grads(model, x, t, y)
    what = enable_checkpointing(model)
    blocks = [m for m in model.modules() if isinstance(m, Checkpointable)]
    assert blocks and all(b.checkpointed for b in blocks)
    assert f"{len(blocks)} blocks" in what
    ckpt, kept_ckpt = _grads(model, x, t, y)
    assert plain.keys() == ckpt.keys()
    for n in plain:  # the same computation again, the same dropout masks: the same numbers
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
    assert kept_ckpt < 0.5 * kept_plain, (kept_ckpt, kept_plain)
    with torch.no_grad():  # sampling: no checkpoint (and the same output)
        model.eval()
        a = model(x, t, y)
        for b in blocks:
            b.checkpointed = False
        torch.testing.assert_close(model(x, t, y), a)


def test_a_run_with_checkpointing_trains_the_same_weights(tmp_path, capsys):
    common = TINY_MODEL + ["train.steps=3", "train.checkpoint_every=0", "train.device=cpu",
                           "train.num_threads=1", "logging.log_every=1", "sample.num=2",
                           "sample.steps=2"]
    for on in (False, True):
        cfg = load_config(None, common + [f"train.gradient_checkpointing={str(on).lower()}"])
        steadydiff.train(cfg, out_dir=tmp_path / str(on))
        assert ("gradient checkpointing: " in capsys.readouterr().out) == on
    a, b = (ckpt.load_checkpoint(ckpt.latest_good(tmp_path / r / "checkpoints"))
            for r in ("False", "True"))
    for k in a.model:
        torch.testing.assert_close(b.model[k], a.model[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_model_without_blocks_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="train.gradient_checkpointing"):
        enable_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("text_encoder", [False, True])
def test_sd_lora_checkpointing_uses_the_libraries_switches(tmp_path, text_encoder):
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from steadydiff.integrations.sd import setup as sd_setup
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    sd = make_tiny_sd(tmp_path / "sd", image_size=32)
    (tmp_path / "data").mkdir()
    cfg = load_config("configs/sd_lora.yaml", [
        f"model.pretrained={sd}", f"data.path={tmp_path / 'data'}", "data.image_size=32",
        "train.precision=fp32", "train.device=cpu", "adapter.rank=4", "adapter.alpha=4",
        f"adapter.text_encoder={str(text_encoder).lower()}"])
    torch.manual_seed(0)
    model, _, media = sd_setup.build(cfg, torch.device("cpu"))
    model.train()
    for n, p in model.named_parameters():  # LoRA B starts at zero: make every path count
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    x, t = torch.randn(2, 4, 4, 4), torch.tensor([10., 500.])
    y = media.tokenize(["a red square", "a circle"]) if text_encoder else \
        torch.randn(2, model.null_context.shape[0], model.context_dim)
    plain, kept_plain = _grads(model, x, t, y)
    what = enable_checkpointing(model)
    assert model.unet.is_gradient_checkpointing
    assert ("text encoder" in what) == text_encoder
    if text_encoder:
        assert any(getattr(m, "gradient_checkpointing", False) is True
                   for m in model.text_encoder.modules())
        assert any(k.startswith("text_encoder.") for k in plain)
    ckpt, kept_ckpt = _grads(model, x, t, y)
    assert plain.keys() == ckpt.keys()  # the text encoder's LoRA still gets its gradients
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-4, atol=1e-6, msg=n)
    assert kept_ckpt < kept_plain, (kept_ckpt, kept_plain)


def test_provenance_still_names_the_first_bad_module_when_checkpointed():
    """The guard's replay hooks every module: with the blocks recomputed in the backward the
    hooks fire twice, and the first non-finite module named is still the one that broke."""
    from steadydiff.guard import provenance

    cfg = load_config(None, TINY_MODEL)
    torch.manual_seed(0)
    m = build_model(cfg.model, image_size=8, channels=1).train()
    enable_checkpointing(m)
    with torch.no_grad():
        m.mid.res[1].conv1.weight.view(-1)[0] = float("nan")
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([10, 90]), torch.zeros(2, dtype=torch.long)
    out = provenance.trace(m, lambda i: m(x, t, y).square().mean(), 1)
    assert out["reproduced"] and out["first_nonfinite_module"] == "mid.res.1.conv1"
    assert out["nonfinite_grad_count"] > 0


def test_8bit_adamw_is_refused_off_cuda_naming_the_key(tmp_path):
    """bitsandbytes' 8-bit AdamW has CUDA kernels only: on this CPU the dry run refuses it
    (exit 2) with the key and what to use instead, before anything is built."""
    import subprocess
    import sys

    from steadydiff.trainer.optim import OptimizerError, check_optimizer

    cfg = load_config(None, TINY_MODEL + ["optim.optimizer=adamw8bit"])
    with pytest.raises(OptimizerError, match="optim.optimizer=adamw8bit.*CUDA.*optim.optimizer"
                                             "=adamw"):
        check_optimizer(cfg.optim, torch.device("cpu"))
    check_optimizer(load_config(None, TINY_MODEL).optim, torch.device("cpu"))  # adamw: fine
    p = subprocess.run([sys.executable, "-m", "steadydiff", "train", "configs/digits_cond.yaml",
                        "--dry-run", "--set",
                        *TINY_MODEL, "optim.optimizer=adamw8bit", "train.device=cpu",
                        "--out", str(tmp_path / "r")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "optim.optimizer=adamw8bit" in p.stderr, p.stderr
    with pytest.raises(Exception, match="optim.fused"):
        load_config(None, ["optim.optimizer=adamw8bit", "optim.fused=true"])
    with pytest.raises(Exception, match="adamw8bit"):
        load_config(None, ["optim.optimizer=sgd"])
