"""Offline evaluation: metrics against closed forms, the feature network and its cache,
Fashion-MNIST files, NaN-proof evaluation, and eval during training (best, early stopping)."""

import gzip
import json
import os
import struct

import numpy as np
import pytest
import scipy.linalg
import torch

import steadydiff
from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.data import DataError, FashionMNISTDataset, build_dataset
from steadydiff.eval import features, metrics
from steadydiff.eval.during import EarlyStopping
from steadydiff.eval.evaluate import evaluate_checkpoint, evaluate_samples
from steadydiff.trainer import checkpoint as ckpt

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + ["train.checkpoint_every=0", "sample.num=10", "sample.steps=4",
                     "logging.log_every=5", "logging.report=false"]
# a cheap evaluation: 20 samples, 3 sampler steps
EVAL = ["eval.num=20", "eval.steps=3", "eval.sampler=ddim"]


# --------------------------------------------------------------------------- metrics


def test_frechet_distance_closed_form_gaussians():
    # diagonal covariances: FD = |mu1 - mu2|^2 + sum (sqrt(a) - sqrt(b))^2
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    a, b = np.array([1.0, 4.0, 9.0]), np.array([4.0, 1.0, 1.0])
    expect = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    assert metrics.frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expect)
    # general covariances: the textbook formula with scipy's sqrtm
    g = np.random.default_rng(0)
    m1, m2 = g.normal(size=(5, 5)), g.normal(size=(5, 5))
    s1, s2 = m1 @ m1.T, m2 @ m2.T
    ref = np.trace(s1 + s2 - 2 * scipy.linalg.sqrtm(s1 @ s2).real)
    assert metrics.frechet_distance(np.zeros(5), s1, np.zeros(5), s2) == pytest.approx(ref)
    assert metrics.frechet_distance(np.ones(5), s1, np.ones(5), s1) == pytest.approx(0, abs=1e-9)
    # from samples: converges to the closed form
    x = g.normal(mu1, np.sqrt(a), size=(200_000, 3))
    y = g.normal(mu2, np.sqrt(b), size=(200_000, 3))
    assert metrics.frechet_distance_features(x, y) == pytest.approx(expect, rel=0.02)


def test_kid_is_unbiased_and_detects_a_shift():
    g = np.random.default_rng(1)
    vals = [metrics.kernel_inception_distance(g.normal(size=(100, 8)), g.normal(size=(100, 8)),
                                              subsets=5, seed=i)[0] for i in range(40)]
    # two samples of one distribution: mean ~0 (the biased estimator would be clearly > 0)
    assert abs(np.mean(vals)) < 3 * np.std(vals) / np.sqrt(len(vals))
    assert min(vals) < 0 < max(vals)
    # identical sets: the unbiased estimator is exactly the off-diagonal formula
    x = g.normal(size=(50, 4))
    k = (x @ x.T / 4 + 1) ** 3
    off = (k.sum() - np.trace(k)) / (50 * 49)
    kid, std = metrics.kernel_inception_distance(x, x, subsets=3, subset_size=50)
    assert kid == pytest.approx(2 * off - 2 * k.mean()) and std == pytest.approx(0, abs=1e-12)
    shifted = metrics.kernel_inception_distance(g.normal(size=(200, 8)),
                                                g.normal(0.5, 1, size=(200, 8)))[0]
    assert shifted > 10 * np.std(vals)


def test_precision_recall_on_point_clouds():
    grid = np.stack(np.meshgrid(np.arange(10.0), np.arange(10.0)), -1).reshape(-1, 2)
    assert metrics.precision_recall(grid, grid + 0.01) == (1.0, 1.0)
    p, r = metrics.precision_recall(grid, grid + 100.0)
    assert p == 0.0 and r == 0.0
    # fakes all in one corner: faithful (precision 1) but covering little (low recall)
    corner = grid[(grid[:, 0] < 3) & (grid[:, 1] < 3)] + 0.1
    p, r = metrics.precision_recall(grid, corner)
    assert p == 1.0 and r < 0.3
    # half the fakes far away: precision 0.5, recall of the half that overlaps
    half = np.concatenate([grid[:50] + 0.01, grid[50:] + 100.0])
    p, r = metrics.precision_recall(grid, half)
    assert p == 0.5 and 0.45 <= r <= 0.6
    with pytest.raises(ValueError, match="k must be"):
        metrics.precision_recall(grid, grid, k=100)


# --------------------------------------------------------------------------- feature network


def test_feature_net_is_deterministic():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 8, 8, generator=g) * 2 - 1, torch.arange(64) % 10
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = features.train_feature_net(x, y, steps=5, batch_size=16, seed=0)
    assert torch.equal(torch.rand(3), before)  # the caller's global RNG is untouched
    b = features.train_feature_net(x, y, steps=5, batch_size=16, seed=0)
    c = features.train_feature_net(x, y, steps=5, batch_size=16, seed=1)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert any(not torch.equal(v, c.state_dict()[k]) for k, v in a.state_dict().items())


def test_feature_extractor_cache_and_corruption(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(features.RECIPE, "digits", (30, 32))
    fx = features.feature_extractor("digits", 8, cache=tmp_path)
    assert fx.real.shape == (1797, features.FEATURE_DIM) and fx.meta["test_accuracy"] > 0.5
    assert "training the digits feature network" in capsys.readouterr().err
    again = features.feature_extractor("digits", 8, cache=tmp_path)
    assert "training" not in capsys.readouterr().err  # loaded, not retrained
    np.testing.assert_array_equal(again.real, fx.real)
    (fx.path / "weights.safetensors").write_bytes(b"garbage")
    rebuilt = features.feature_extractor("digits", 8, cache=tmp_path)
    assert "unreadable" in capsys.readouterr().err
    np.testing.assert_array_equal(rebuilt.real, fx.real)  # same seed: the same network
    with pytest.raises(ValueError, match="labelled dataset.*--inception-weights"):
        features.feature_extractor("folder", 8, cache=tmp_path)


def test_evaluate_samples_counts_nonfinite_and_never_crashes(tmp_path, monkeypatch):
    monkeypatch.setitem(features.RECIPE, "digits", (100, 32))
    fx = features.feature_extractor("digits", 8, cache=tmp_path)
    from steadydiff.data import DigitsDataset
    x = DigitsDataset(8).images[:60].clone()
    y = DigitsDataset(8).labels[:60]
    good = evaluate_samples(fx, x, y)
    assert good["num_nonfinite"] == 0 and good["class_accuracy"] > 0.5
    noise = evaluate_samples(fx, torch.rand_like(x) * 2 - 1, y)
    assert noise["fd"] > 2 * good["fd"] and noise["precision"] < good["precision"]
    assert good["real_floor"]["fd"] < noise["fd"]
    x[:10] = float("nan")
    part = evaluate_samples(fx, x, y)
    assert part["num_nonfinite"] == 10 and part["num"] == 60
    # the non-finite rows are dropped, not scored: the figures are those of the other 50
    rest = evaluate_samples(fx, x[10:], y[10:])
    assert rest["num_nonfinite"] == 0
    for key in ("fd", "kid", "precision", "recall", "class_accuracy"):
        assert part[key] == rest[key], key
    x[:] = float("nan")
    none = evaluate_samples(fx, x, y)
    assert none["num_nonfinite"] == 60 and none["fd"] is None and "finite" in none["error"]
    json.dumps(none)  # JSON-able


# --------------------------------------------------------------------------- Fashion-MNIST


def _write_idx(path, arr):
    arr = np.asarray(arr, np.uint8)
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(head + arr.tobytes())


def make_fashion(root, n_train=40, n_test=20):
    root.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(root / f"{split}-images-idx3-ubyte.gz", g.integers(0, 256, (n, 28, 28)))
        _write_idx(root / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return root


def test_fashion_mnist_from_idx_files(tmp_path):
    root = make_fashion(tmp_path / "fm")
    d = FashionMNISTDataset(16, 3, root=root)
    x, y = d[5]
    assert len(d) == 40 and x.shape == (3, 16, 16) and y == 5 and -1 <= x.min() <= x.max() <= 1
    assert len(FashionMNISTDataset(28, 1, root=root, split="test")) == 20
    cfg = load_config(None, ["data.dataset=fashion_mnist", f"data.path={root}",
                             "data.image_size=28"])
    x28, _ = build_dataset(cfg.data)[0]
    raw = np.frombuffer(gzip.open(root / "train-images-idx3-ubyte.gz").read()[16:], np.uint8)
    np.testing.assert_allclose(x28[0].numpy(), raw[:784].reshape(28, 28) / 127.5 - 1, atol=1e-6)


def test_fashion_mnist_missing_or_broken_files_are_clear(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist.*data.path"):
        FashionMNISTDataset(28, root=tmp_path / "nowhere")
    root = make_fashion(tmp_path / "fm")
    data = gzip.open(root / "train-images-idx3-ubyte.gz").read()
    with gzip.open(root / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(data[:1000])
    with pytest.raises(DataError, match="truncated"):
        FashionMNISTDataset(28, root=root)


def test_fashion_feature_net_uses_the_official_split(tmp_path, monkeypatch):
    monkeypatch.setitem(features.RECIPE, "fashion_mnist", (5, 16))
    root = make_fashion(tmp_path / "fm")
    fx = features.feature_extractor("fashion_mnist", 16, path=str(root), cache=tmp_path / "c")
    assert fx.meta["num_train"] == 40 and fx.meta["num_test"] == 20
    assert fx.real.shape == (40, features.FEATURE_DIM)


# --------------------------------------------------------------------------- early stopping


def test_early_stopping_patience_on_a_scripted_sequence():
    es = EarlyStopping(lower_is_better=True, patience=2, min_delta=0.1)
    seq = [(10, 5.0, True), (20, 4.95, False), (30, 4.8, True), (40, 4.75, False),
           (50, float("nan"), False)]
    for step, v, improved in seq:
        assert es.update(v, step) is improved, step
    assert es.should_stop and es.best == 4.8 and es.best_step == 30 and es.bad == 2
    resumed = EarlyStopping(True, 2, 0.1)
    resumed.load_state_dict(json.loads(json.dumps(es.state_dict())))
    assert resumed.should_stop and resumed.best == 4.8
    up = EarlyStopping(lower_is_better=False, patience=3)
    assert [up.update(v, i) for i, v in enumerate([0.5, 0.6, 0.6, None, 0.7])] == \
        [True, True, False, False, True]
    assert not up.should_stop
    never = EarlyStopping(True, patience=0)
    for i in range(10):
        never.update(1.0, i)
    assert not never.should_stop


# --------------------------------------------------------------------------- during training


def tiny(*extra):
    return load_config(None, TINY + list(extra))


def _weights(run):
    c = ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"))
    return c


def test_eval_during_training_does_not_change_training(tmp_path):
    steadydiff.train(tiny("train.steps=8"), out_dir=tmp_path / "plain")
    res = steadydiff.train(tiny("train.steps=8", "eval.every=4", *EVAL),
                           out_dir=tmp_path / "eval")
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "eval")
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
    rows = [json.loads(line)
            for line in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8] and res.stopped_early is None
    assert all(r["metric"] == "FD-digits" and r["fd"] > 0 for r in rows)
    best = tmp_path / "eval" / "checkpoints" / "best"
    assert ckpt.resolve_checkpoint(best).name == f"step_{rows[-1]['best_step']:08d}"
    pipe = steadydiff.load(best)  # the best checkpoint is a normal, loadable checkpoint
    assert pipe.step == rows[-1]["best_step"]
    from steadydiff.report import write_report
    page = write_report(tmp_path / "eval").read_text()
    assert 'alt="FD, precision and recall over steps"' in page


def test_best_checkpoint_survives_rotation_and_early_stop_is_resume_safe(tmp_path, capsys):
    # min_delta is huge: only the first evaluation is a "best"; patience 2 stops at step 15
    args = ["train.steps=10", "train.checkpoint_every=5", "train.keep_checkpoints=1",
            "eval.every=5", "eval.patience=2", "eval.min_delta=1e9", *EVAL]
    run = tmp_path / "r"
    res = steadydiff.train(tiny(*args), out_dir=run)
    assert res.steps == 10 and res.stopped_early is None
    # resume with more steps: the patience counter (1 at step 10) came back with the state
    res = steadydiff.train(tiny(*args, "train.steps=30"), out_dir=run)
    assert res.steps == 15 and "early stopping" in res.stopped_early
    assert "best" in res.stopped_early and "step 5" in res.stopped_early
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and "early stopping" in summary["reason"]
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_00000015"]
    assert ckpt.resolve_checkpoint(run / "checkpoints" / "best").name == "step_00000005"
    rows = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["improved"], r["bad_evals"]) for r in rows] == \
        [(5, True, 0), (10, False, 1), (15, False, 2)]
    # rerunning the stopped run trains nothing more
    assert steadydiff.train(tiny(*args, "train.steps=30"), out_dir=run).steps == 15


def test_eval_of_a_nan_checkpoint_reports_instead_of_crashing(tmp_path, capsys):
    run = tmp_path / "r"
    steadydiff.train(tiny("train.steps=2"), out_dir=run)
    path = ckpt.latest_good(run / "checkpoints")
    # poison the EMA weights on disk and re-sign the manifest, as a diverged run's file would be
    from safetensors.torch import load_file, save_file
    ema = load_file(str(path / "ema.safetensors"))
    for v in ema.values():
        v.fill_(float("nan"))
    save_file(ema, str(path / "ema.safetensors"))
    mf = json.loads((path / "manifest.json").read_text())
    mf["files"]["ema.safetensors"] = {"size": (path / "ema.safetensors").stat().st_size,
                                      "sha256": ckpt._sha256(path / "ema.safetensors")}
    (path / "manifest.json").write_text(json.dumps(mf))
    res = evaluate_checkpoint(run, num=12, steps=2)
    assert res["num_nonfinite"] == 12 and res["fd"] is None and "non-finite" in res["error"]
    assert main(["eval", str(run), "--num", "12", "--steps", "2"]) == 1
    assert "NON-FINITE" in capsys.readouterr().out


def test_eval_config_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="eval.k"):
        tiny("eval.k=30", "eval.num=20")
    with pytest.raises(ConfigError, match="eval.every needs a labelled dataset"):
        load_config(None, ["data.dataset=folder", f"data.path={tmp_path}", "eval.every=10"])
    with pytest.raises(ConfigError, match="eval.metric"):
        tiny("eval.metric=fid")


# --------------------------------------------------------------------------- Inception


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory):
    from steadydiff.eval.inception import FIDInceptionV3
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("inc") / "pt_inception-random.pth"
    torch.save(FIDInceptionV3().state_dict(), path)
    return path


def test_inception_loads_standard_keys_and_gives_2048_features(inception_file):
    from steadydiff.eval.inception import inception_features, load_inception
    sd = torch.load(inception_file, weights_only=True)
    for key in ("Conv2d_1a_3x3.conv.weight", "Mixed_5b.branch_pool.bn.running_var",
                "Mixed_7c.branch3x3dbl_3b.conv.weight", "fc.weight"):
        assert key in sd
    assert sd["fc.weight"].shape == (1008, 2048)
    net = load_inception(inception_file)
    f = inception_features(net, torch.rand(2, 1, 16, 16) * 2 - 1)
    assert f.shape == (2, 2048) and np.isfinite(f).all()


def test_inception_bad_files_are_clear(tmp_path, inception_file):
    from steadydiff.eval.inception import InceptionWeightsError, load_inception
    with pytest.raises(InceptionWeightsError, match="not found.*never downloads"):
        load_inception(tmp_path / "missing.pth")
    sd = torch.load(inception_file, weights_only=True)
    sd.pop("Mixed_6b.branch7x7_2.conv.weight")
    sd["AuxLogits.fc.weight"] = torch.zeros(3)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(InceptionWeightsError,
                       match="missing keys: Mixed_6b.branch7x7_2.conv.weight.*unexpected keys: "
                             "AuxLogits.fc.weight"):
        load_inception(tmp_path / "bad.pth")
    torch.save({"x": object}, tmp_path / "pickle.pth")  # not loadable with weights_only
    with pytest.raises(InceptionWeightsError, match="cannot be loaded"):
        load_inception(tmp_path / "pickle.pth")


def test_cli_eval_with_inception_weights(tmp_path, inception_file, capsys):
    run = tmp_path / "r"
    steadydiff.train(tiny("train.steps=1"), out_dir=run)
    capsys.readouterr()
    out = tmp_path / "e.json"
    assert main(["eval", str(run), "--num", "6", "--steps", "2", "-k", "2",
                 "--inception-weights", str(inception_file), "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)  # --json: stdout is one JSON document
    assert printed == json.loads(out.read_text())
    inc = printed["inception"]
    assert inc["fid"] >= 0 and inc["num_real"] == 6 and "rank-deficient" in inc["note"]
    assert main(["eval", str(run), "--inception-weights", str(tmp_path / "none.pth")]) == 2


@pytest.mark.slow  # two torchrun processes: ~12-14 s
def test_two_ranks_evaluate_once_and_stop_early_together(tmp_path):
    # torchrun with two CPU processes: rank 0 measures and writes, both ranks get its
    # best/patience state and stop at the same step (a rank that kept going would hang)
    from test_distributed import launch, ranks
    rc, log = launch(tmp_path, "eval.every=2", "eval.patience=1", "eval.min_delta=1e9", *EVAL)
    assert rc == 0, log
    _, info = ranks(tmp_path)
    assert [i["step"] for i in info] == [4, 4]
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["improved"]) for r in rows] == [(2, True), (4, False)]
    assert "early stopping" in json.loads((tmp_path / "summary.json").read_text())["reason"]
