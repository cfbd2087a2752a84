"""Atomic, verified checkpoints: round trip, corruption detection, rotation, safe loading."""

import json
import os
import pickle

import pytest
import torch
from torch import nn

from steadydiff.trainer import checkpoint as ckpt


def _parts(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.GroupNorm(2, 8), nn.Linear(8, 2))
    ema = nn.Sequential(nn.Linear(4, 8), nn.GroupNorm(2, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, ema, opt


def _save(root, step, model, ema, opt, keep=3):
    return ckpt.save_checkpoint(root, step, model=model, ema=ema, optimizer=opt,
                                state={"batches_consumed": step, "config": {}}, keep=keep)


def test_round_trip(tmp_path):
    model, ema, opt = _parts()
    path = _save(tmp_path, 5, model, ema, opt)
    assert path.name == "step_00000005" and (tmp_path / "latest").read_text().strip() == path.name
    assert ckpt.verify_checkpoint(path) == []
    c = ckpt.load_checkpoint(path)
    assert c.step == 5 and c.state["batches_consumed"] == 5
    for k, v in model.state_dict().items():
        assert torch.equal(c.model[k], v)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(c.optimizer)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_rng_round_trip():
    import random
    import numpy as np
    state = ckpt.capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1))
    ckpt.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1)) == a


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_corruption_is_detected_and_previous_used(tmp_path, damage):
    model, ema, opt = _parts()
    _save(tmp_path, 1, model, ema, opt)
    newest = _save(tmp_path, 2, model, ema, opt)
    target = newest / "model.safetensors"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "delete":
        target.unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    assert ckpt.verify_checkpoint(newest)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_checkpoint(newest)
    assert ckpt.latest_good(tmp_path).name == "step_00000001"


def test_non_finite_state_is_never_written(tmp_path):
    model, ema, opt = _parts()
    good = _save(tmp_path, 1, model, ema, opt)
    with torch.no_grad():
        ema[0].weight[0, 0] = float("nan")
    with pytest.raises(ckpt.CheckpointError, match="non-finite values in ema:0.weight"):
        _save(tmp_path, 2, model, ema, opt)
    assert ckpt.list_checkpoints(tmp_path) == [good]
    assert ckpt.latest_good(tmp_path) == good


def test_rotation_keeps_last_k_and_cleans_temporaries(tmp_path):
    model, ema, opt = _parts()
    (tmp_path / ".tmp-step_00000009-999999").mkdir()  # left by a writer killed mid-save
    for s in range(1, 6):
        _save(tmp_path, s, model, ema, opt, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000005", "step_00000004"]
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_malicious_pickle_is_refused_without_running(tmp_path):
    model, ema, opt = _parts()
    path = _save(tmp_path, 1, model, ema, opt)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = path / "optimizer.pt"
    with open(evil, "wb") as f:
        pickle.dump({"state": Payload()}, f)
    # an attacker who also rewrites the manifest passes the checksum, but not the loader
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["optimizer.pt"] = {"size": evil.stat().st_size,
                                         "sha256": ckpt._sha256(evil)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="cannot be loaded safely"):
        ckpt.load_checkpoint(path)
    assert not marker.exists()


def test_resolve_checkpoint(tmp_path):
    model, ema, opt = _parts()
    run = tmp_path / "run"
    path = _save(run / "checkpoints", 3, model, ema, opt)
    assert ckpt.resolve_checkpoint(run) == path
    assert ckpt.resolve_checkpoint(run / "checkpoints") == path
    assert ckpt.resolve_checkpoint(path) == path
    with pytest.raises(ckpt.CheckpointError, match="no such"):
        ckpt.resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint"):
        ckpt.resolve_checkpoint(tmp_path)
