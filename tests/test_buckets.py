"""Aspect-ratio bucketing (data/buckets.py): the bucket set and assignment, the crop that SDXL
records, single-bucket batches that replay exactly (resume, torchrun ranks), the latent cache
keyed by bucket, and a tiny Stable Diffusion LoRA run on mixed aspect ratios that resumes
bit-exactly mid-epoch and reports its histogram."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from steadydiff.config import ConfigError, load_config
from steadydiff.data import ImageFolderDataset, make_loader
from steadydiff.data.buckets import (BucketBatchSampler, assign, bucket_layout, make_buckets,
                                     plan_crop, time_ids)
from steadydiff.data.cache import EncodedDataset, encode_latents

# 32-px base, step 8, sides 16..64, ratio <= 2: three buckets
BUCKETS = [(24, 40), (32, 32), (40, 24)]
# (width, height) of the test images: landscapes, squares, portraits (in that bucket order
# when assigned: 40x24 is bucket 2)
SIZES = [(60, 36), (50, 30), (33, 32), (40, 41), (24, 40), (30, 52), (64, 40), (36, 36),
         (20, 34), (48, 28)]


def images(root: Path, sizes=SIZES, captions: bool = True) -> Path:
    """One PNG per size, each its own content (a colored bar at its own place)."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate(sizes):
        a = np.full((h, w, 3), 240, np.uint8)
        a[(i * 3) % h:(i * 3) % h + h // 4, :, :] = (200 - 15 * i, 40 + 12 * i, 90)
        a[:, (i * 5) % w, 2] = 10
        Image.fromarray(a).save(root / f"im{i:02d}.png")
        if captions:
            (root / f"im{i:02d}.txt").write_text(f"a bar number {i}")
    return root


def test_buckets_are_about_the_base_area_and_sides_are_multiples_of_the_step():
    assert make_buckets(32, 8, 16, 64, 2.0) == BUCKETS
    sd = make_buckets(512, 64, 256, 1024, 4.0)
    assert (512, 512) in sd and (768, 320) in sd and (320, 768) in sd
    for w, h in sd:
        assert w % 64 == 0 and h % 64 == 0 and 256 <= min(w, h) and max(w, h) <= 1024
        assert w * h <= 512 * 512 and w * h > 0.75 * 512 * 512  # about equal area
        assert max(w, h) / min(w, h) <= 4.0
    assert max(max(b) / min(b) for b in make_buckets(512, 64, 256, 1024, 2.0)) <= 2.0


def test_each_image_goes_to_the_bucket_of_the_closest_aspect_ratio():
    ids = assign(SIZES, BUCKETS)
    assert ids == [2, 2, 1, 1, 0, 0, 2, 1, 0, 2]
    # log-ratio distance: 2:1 and 1:2 are equally far from the square
    assert assign([(1000, 100), (100, 1000), (31, 30)], BUCKETS) == [2, 0, 1]


@pytest.mark.parametrize("random", [False, True])
def test_the_crop_covers_the_bucket_and_is_recorded_as_sdxl_wants(random):
    c = plan_crop(60, 30, (40, 24), random=random, seed=3, index=1)
    assert c.original_size == (30, 60) and c.target_size == (24, 40)
    top, left = c.crop_top_left
    # resized to cover 40x24 keeping 2:1: 48x24, so the crop slides along the width only
    assert top == 0 and 0 <= left <= 8 and (random or left == 4)
    assert c.time_ids() == (30, 60, top, left, 24, 40)
    l, t, r, b = c.box
    assert (r - l) / (b - t) == pytest.approx(40 / 24)  # no stretching
    again = plan_crop(60, 30, (40, 24), random=random, seed=3, index=1)
    assert again == c  # seeded: the same crop every epoch and after a resume


def test_folder_images_come_out_at_their_buckets_size(tmp_path):
    root = images(tmp_path / "im", captions=False)
    ds = ImageFolderDataset(root, 32, 3, buckets=BUCKETS)
    lay = ds.bucket_layout
    assert lay is not None and lay.ids == assign(SIZES, BUCKETS)
    for i in range(len(ds)):
        w, h = BUCKETS[lay.ids[i]]
        x, _ = ds[i]
        assert x.shape == (3, h, w) and -1 <= x.min() and x.max() <= 1
    t = time_ids(ds, torch.tensor([0, 4]))
    assert t.shape == (2, 6) and t[0].tolist()[:2] == [36, 60] and t[1].tolist()[4:] == [40, 24]


def test_every_batch_is_one_bucket_and_the_stream_replays_from_any_batch():
    ids = [0, 0, 0, 1, 1, 2, 0, 0, 1, 2, 2, 0, 1]
    s = BucketBatchSampler(ids, 4, seed=7)
    assert s.epoch_batches == sum(math.ceil(ids.count(k) / 4) for k in set(ids))
    seen = {e: set() for e in range(3)}
    for b in range(3 * s.epoch_batches):
        keys = s.global_batch_indices(b)
        assert len(keys) == 4 and len({ids[i] for i, _ in keys}) == 1, keys
        assert {ids[i] for i, _ in keys} == {s.bucket_of_batch(b)}
        seen[s.epoch_of(b)].update(i for i, _ in keys)
    assert all(v == set(range(len(ids))) for v in seen.values())  # no image dropped
    # another seed, another order; a resume at batch 5 yields what batch 5 was
    assert [s.global_batch_indices(b) for b in range(4)] != \
        [BucketBatchSampler(ids, 4, seed=8).global_batch_indices(b) for b in range(4)]
    resumed = iter(BucketBatchSampler(ids, 4, seed=7, start_batch=5))
    assert [next(resumed) for _ in range(6)] == [s.batch_indices(b) for b in range(5, 11)]
    # torchrun: the ranks' slices of a batch are one bucket together and cover it
    ranks = [BucketBatchSampler(ids, 4, seed=7, rank=r, world_size=2) for r in range(2)]
    for b in range(8):
        assert ranks[0].batch_indices(b) + ranks[1].batch_indices(b) == \
            s.global_batch_indices(b)
    # the quarantine leaves a sample out of every epoch, the batches stay single-bucket
    q = BucketBatchSampler(ids, 4, seed=7, exclude=[5, 9, 10])  # all of bucket 2
    assert all(ids[i] != 2 for b in range(10) for i, _ in q.global_batch_indices(b))


def test_the_loader_batches_a_bucketed_folder_one_shape_at_a_time(tmp_path):
    root = images(tmp_path / "im", captions=False)
    ds = ImageFolderDataset(root, 32, 3, buckets=BUCKETS)
    it = iter(make_loader(ds, batch_size=3, seed=0))
    shapes = set()
    for _ in range(6):
        x, _, idx, _ = next(it)
        assert x.shape[0] == 3
        assert {ds.bucket_layout.ids[i] for i in idx.tolist()} == \
            {BUCKETS.index((x.shape[-1], x.shape[-2]))}
        shapes.add(tuple(x.shape[-2:]))
    assert len(shapes) == 3


def test_latent_cache_is_keyed_by_bucket_and_encodes_each_image_alone(tmp_path):
    root = images(tmp_path / "im", captions=False)
    calls = []

    def encode(x):
        calls.append(tuple(x.shape))
        return x[:, :2, ::2, ::2] * 0.5

    ds = ImageFolderDataset(root, 32, 3, buckets=BUCKETS)
    a = encode_latents(ds, encode, encoder_id="e", prep="p", cache_dir=tmp_path / "c")
    assert a.misses == len(SIZES) and isinstance(a.latents, list)
    # one call per image (a latent never depends on its batch), at its bucket's shape
    assert calls == [(1, 3, *reversed(BUCKETS[k])) for k in ds.bucket_layout.ids]
    enc = EncodedDataset(ds, a)
    for i in range(len(enc)):
        w, h = BUCKETS[enc.bucket_layout.ids[i]]
        assert enc[i][0].shape == (2, h // 2, w // 2)
    # the same buckets hit; other buckets (another step) miss instead of being misread
    b = encode_latents(ImageFolderDataset(root, 32, 3, buckets=BUCKETS), encode,
                       encoder_id="e", prep="p", cache_dir=tmp_path / "c")
    assert b.hits == len(SIZES) and b.misses == 0
    other = make_buckets(32, 16, 16, 64, 4.0)
    c = encode_latents(ImageFolderDataset(root, 32, 3, buckets=other), encode,
                       encoder_id="e", prep="p", cache_dir=tmp_path / "c")
    moved = sum(other[k] != BUCKETS[j] for k, j in
                zip(bucket_layout(ImageFolderDataset(root, 32, 3, buckets=other)).ids,
                    assign(SIZES, BUCKETS)))
    assert moved and c.misses >= moved


# --------------------------------------------------------------------------- config


def _cfg(*sets: str):
    return load_config(None, ["data.dataset=folder", "data.path=/nonexistent",
                              "model.pretrained=/x", "data.captions=auto",
                              "data.buckets=true", "data.image_size=32",
                              "data.bucket_step=8", *sets])


@pytest.mark.parametrize("sets, needle", [
    (["data.bucket_min_side=20"], "data.bucket_min_side=20 is not a multiple of "
                                  "data.bucket_step=8"),
    (["data.bucket_max_side=24"], "must lie between data.bucket_min_side"),
    (["data.bucket_step=64"], "data.image_size=32 is not a multiple of data.bucket_step=64"),
    (["data.bucket_crop=top"], "bucket_crop"),
    (["data.bucket_max_ratio=0.5"], "bucket_max_ratio"),
])
def test_bad_bucket_settings_are_refused_naming_the_key(sets, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        _cfg(*sets)


def test_buckets_are_refused_for_square_only_models_and_datasets():
    with pytest.raises(ConfigError, match="steadydiff's own UNet and DiT are built for"):
        load_config(None, ["data.dataset=folder", "data.path=/x", "data.buckets=true",
                           "data.image_size=64"])
    with pytest.raises(ConfigError, match="data.dataset=digits has one square size"):
        load_config(None, ["data.buckets=true", "data.image_size=64"])


# --------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


def sd_config(sd: Path, data: Path, *sets: str):
    base = [f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
            "data.buckets=true", "data.bucket_step=8", "data.bucket_min_side=16",
            "data.bucket_max_side=64", "data.bucket_max_ratio=2",
            "train.batch_size=2", "train.precision=fp32", "train.sample_every=0",
            "train.num_threads=1", "train.device=cpu", "sample.num=1", "sample.steps=1",
            "optim.warmup_steps=0", "optim.schedule=constant", "logging.log_every=1",
            "guard.warmup_steps=0", "data.num_workers=0", "adapter.rank=2", "adapter.alpha=2"]
    return load_config("configs/sd_lora.yaml", base + list(sets))


def test_mixed_aspect_folder_trains_and_resumes_bit_exactly_mid_epoch(sd_dir, tmp_path,
                                                                     capsys):
    import steadydiff
    from steadydiff.trainer import checkpoint as ckpt

    data = images(tmp_path / "im")  # 10 images: 4 + 3 + 3 -> 2 + 2 + 2 batches of 2
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    straight = steadydiff.train(sd_config(sd_dir, data, cache, "train.steps=4",
                                          "train.checkpoint_every=4"),
                                out_dir=tmp_path / "straight")
    out = capsys.readouterr().out
    assert "buckets: 3 of 3 hold 10 images" in out and "40x24" in out
    # 6 batches an epoch: step 2 is mid-epoch
    steadydiff.train(sd_config(sd_dir, data, cache, "train.steps=2",
                               "train.checkpoint_every=2"), out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(sd_config(sd_dir, data, cache, "train.steps=4",
                                         "train.checkpoint_every=2"),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None and resumed.steps == 4
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k
    hist = json.loads((tmp_path / "straight" / "buckets.json").read_text())
    assert [(r["width"], r["height"], r["images"]) for r in hist["buckets"]] == \
        [(24, 40, 3), (32, 32, 3), (40, 24, 4)]
    page = (tmp_path / "straight" / "report.html").read_text()
    assert "<h2>Buckets</h2>" in page and "40×24" in page


@pytest.mark.slow
def test_two_ranks_train_single_bucket_batches_in_step(sd_dir, tmp_path):
    """torchrun, two CPU processes: the ranks take their slices of the same one-bucket global
    batch at every step, so they end identical and match one process that trained the whole
    global batches (ranks drawing other samples or other buckets would not)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]
    data = images(tmp_path / "im")
    overrides = [f"model.pretrained={sd_dir}", f"data.path={data}", "data.image_size=32",
                 "data.buckets=true", "data.bucket_step=8", "data.bucket_min_side=16",
                 "data.bucket_max_side=64", "data.bucket_max_ratio=2", "train.batch_size=2",
                 "train.precision=fp32", "train.sample_every=0", "train.device=cpu",
                 "sample.num=1", "sample.steps=1", "optim.warmup_steps=0",
                 "optim.schedule=constant", "logging.log_every=1", "guard.warmup_steps=0",
                 "adapter.rank=2", "adapter.alpha=2", "train.steps=4",
                 "train.checkpoint_every=4", "logging.report=false",
                 "guard.rank_check_every=1", "train.dist_timeout=120",
                 f"data.cache_dir={tmp_path / 'cache'}"]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root / "tests"),
                                         env.get("PYTHONPATH", "")])
    outs = {}
    for procs in (2, 1):
        out = tmp_path / f"p{procs}"
        head = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={procs}"] if procs > 1 else [sys.executable])
        r = subprocess.run(head + [str(root / "tests" / "ddp_worker.py"),
                                   str(root / "configs" / "sd_lora.yaml"), str(out),
                                   *overrides], capture_output=True, text=True, env=env,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "buckets: 3 of 3 hold 10 images" in r.stdout
        outs[procs] = out
    r0, r1 = (load_file(str(outs[2] / f"rank{r}.safetensors")) for r in range(2))
    p0 = load_file(str(outs[1] / "rank0.safetensors"))
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
    s0 = json.loads((outs[2] / "rank0.json").read_text())
    assert s0["step"] == 4 and s0["incidents"] == []  # fingerprints agreed at every step
    diff = max((r0[k] - p0[k]).abs().max().item() for k in r0 if k.startswith("model."))
    assert diff < 1e-5, diff
