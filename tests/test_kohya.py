"""kohya datasets as they are (data/kohya.py): ``N_name`` repeat folders, the dataset TOML,
epochs, regularization images balanced as kohya does, prior preservation's loss
composition and an exact resume; samples per epoch counted from the run's own stream."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.data import DataError  # noqa: E402
from steadydiff.data.kohya import balance_reg, read_dataset_toml  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402
from steadydiff.trainer import loop  # noqa: E402

from test_sd import sd_config, sd_dir  # noqa: E402,F401


def images(folder: Path, n: int, color: tuple[int, int, int], captions: list[str] | None = None,
           ext: str = ".txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        im = np.full((32, 32, 3), 240, np.uint8)
        im[4 + i:20 + i, 6:22] = color  # each its own content
        Image.fromarray(im).save(folder / f"im{i}.png")
        if captions is not None:
            (folder / f"im{i}{ext}").write_text(captions[i])
    return folder


def kohya_tree(root: Path) -> tuple[Path, Path]:
    """train/3_sks square (3 images, no captions), train/1_circle (2 captioned),
    train/notes (no repeats: left out); reg/1_square (4 images, no captions)."""
    images(root / "train" / "3_sks square", 3, (200, 30, 30))
    images(root / "train" / "1_circle", 2, (30, 30, 200), ["a blue circle", "a small circle"])
    images(root / "train" / "notes", 1, (0, 0, 0))
    images(root / "reg" / "1_square", 4, (30, 200, 30))
    return root / "train", root / "reg"


@pytest.fixture()
def stream(monkeypatch):
    """Every sample the run's loader yields, by file (counted from the stream itself)."""
    seen: list[str] = []
    real = loop.make_loader

    def recording(dataset, **kw):
        for batch in real(dataset, **kw):
            seen.extend(str(Path(dataset.path_of(int(i))).relative_to(Path(
                dataset.path_of(int(i))).parents[1])) for i in batch[2])
            yield batch

    monkeypatch.setattr(loop, "make_loader", recording)
    return seen


def test_balance_is_kohyas_rule():
    assert balance_reg(11, [1, 1, 1, 1]) == [3, 3, 3, 2]
    assert balance_reg(3, [1, 1, 1, 1, 1]) == [1, 1, 1, 0, 0]  # more reg than train: cut
    assert balance_reg(5, [2, 1]) == [3, 2]
    assert balance_reg(0, [2, 1]) == [2, 1]


def test_repeat_folders_with_reg_images_train_kohyas_epoch(sd_dir, tmp_path, stream, capsys):
    train, reg = kohya_tree(tmp_path)
    cfg = sd_config(sd_dir, train, f"data.reg_path={reg}", "train.epochs=2",
                    "train.batch_size=4", "train.checkpoint_every=0", "data.prior_loss_weight=0.5")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    # instance: 3 x 3 + 2 x 1 = 11 samples; reg: 4 images balanced to 11 (3, 3, 3, 2);
    # an epoch is 22 samples, 2 epochs / batch 4 = 11 steps
    assert res.steps == 11
    out = capsys.readouterr().out
    assert "instance subset 3_sks square: 3 images x 3 repeats = 9 samples, class tokens " \
        "'sks square'" in out
    assert "regularization subset 1_square: 4 images balanced to 11 samples" in out
    assert "epoch: 22 samples = 6 steps of batch 4" in out
    assert "train.epochs=2: 2 x 22 samples / batch 4 = 11 steps" in out
    epoch = Counter(stream[:22])  # the first epoch of the stream: each sample once
    assert epoch == {f"3_sks square/im{i}.png": 3 for i in range(3)} | \
        {f"1_circle/im{i}.png": 1 for i in range(2)} | \
        {"1_square/im0.png": 3, "1_square/im1.png": 3, "1_square/im2.png": 3,
         "1_square/im3.png": 2}
    assert not any("notes" in s for s in stream)
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert c.state["step"] == 11


def test_dataset_toml_is_read_as_kohya_writes_it(sd_dir, tmp_path, stream, capsys):
    inst = images(tmp_path / "inst", 3, (200, 30, 30), ["sks, red, square"] * 3, ".caption")
    reg = images(tmp_path / "cls", 2, (30, 200, 30))
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'''
[general]
shuffle_caption = true
keep_tokens = 1
caption_extension = ".caption"

[[datasets]]
resolution = 32
batch_size = 2

  [[datasets.subsets]]
  image_dir = "{inst.name}"
  num_repeats = 2

  [[datasets.subsets]]
  image_dir = "{reg}"
  is_reg = true
  class_tokens = "square"
''')
    cfg = sd_config(sd_dir, tmp_path, "data.path=null", f"data.dataset_config={toml}",
                    "train.epochs=1", "data.image_size=64", "train.checkpoint_every=0")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    out = capsys.readouterr().out
    for note in ("data.image_size=32 (from the dataset TOML)",
                 "train.batch_size=2 (from the dataset TOML)",
                 "data.caption_shuffle=True (from the dataset TOML)",
                 "data.keep_tokens=1 (from the dataset TOML)"):
        assert note in out
    assert res.steps == 6  # (3 x 2 + 6 reg) / 2
    assert Counter(stream[:12]) == {f"inst/im{i}.png": 2 for i in range(3)} | \
        {f"cls/im{i}.png": 3 for i in range(2)}


def test_subsets_with_their_own_caption_rules_keep_them(sd_dir, tmp_path, monkeypatch,
                                                        capsys):
    """kohya applies shuffle_caption/keep_tokens per subset: a subset that shuffles with its
    first tag kept, beside one that sets neither (kohya's default: as written), in one
    TOML. Every caption the run's stream tokenized is checked against its subset's rule."""
    from steadydiff.data.captions import CaptionVariants

    tags = ["sks", "red", "square", "big", "bright"]
    inst = images(tmp_path / "inst", 3, (200, 30, 30), [", ".join(tags)] * 3)
    circ = images(tmp_path / "circ", 2, (30, 30, 200), ["a, blue, circle, small, round"] * 2)
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'''
[[datasets]]
resolution = 32

  [[datasets.subsets]]
  image_dir = "{inst}"
  shuffle_caption = true
  keep_tokens = 1

  [[datasets.subsets]]
  image_dir = "{circ}"
''')
    seen: list[tuple[str, str]] = []
    real = CaptionVariants.shuffled

    def recording(self, caption, i, epoch, source=None):
        out = real(self, caption, i, epoch, source)
        seen.append((caption, out))
        return out

    monkeypatch.setattr(CaptionVariants, "shuffled", recording)
    cfg = sd_config(sd_dir, tmp_path, "data.path=null", f"data.dataset_config={toml}",
                    "train.epochs=4", "train.batch_size=5", "train.checkpoint_every=0")
    steadydiff.train(cfg, out_dir=tmp_path / "run")
    out = capsys.readouterr().out
    assert ("captions per subset (the dataset TOML): inst: tags shuffled, first 1 kept; "
            "circ: as written") in out
    mine = [o for c, o in seen if c.startswith("sks")]
    theirs = [o for c, o in seen if c.startswith("a,")]
    assert len(mine) >= 12 and len(theirs) >= 8  # 4 epochs of 3 + 2 images
    assert all(o == "a, blue, circle, small, round" for o in theirs)
    assert all(o.split(", ")[0] == "sks" and sorted(o.split(", ")) == sorted(tags)
               for o in mine)
    assert len(set(mine)) > 1  # shuffled across epochs and images


@pytest.mark.parametrize("body, needle", [
    ("[general]\nenable_bucket = true\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = '.'\n",
     "enable_bucket is not read .* set data.buckets"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = '.'\nnum_repeat = 3\n",
     "unknown key 'num_repeat'"),
    ("[[datasets]]\nresolution = [512, 768]\n[[datasets.subsets]]\nimage_dir = '.'\n",
     "resolution = \\[512, 768\\]: steadydiff trains square"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'nowhere'\n", "is not a folder"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = '.'\nnum_repeats = 'ten'\n",
     "num_repeats = 'ten' must be an integer"),
    ("[datasets\n", "not valid TOML"),
])
def test_bad_dataset_toml_is_refused_naming_the_key(tmp_path, body, needle):
    (tmp_path / "d.toml").write_text(body)
    with pytest.raises(DataError, match=needle):
        read_dataset_toml(tmp_path / "d.toml")


def test_prior_loss_is_instance_plus_weight_times_prior():
    """loss = (sum over instance samples + w x sum over prior samples) / N, per sample w_i."""
    from steadydiff.config import DiffusionConfig
    from steadydiff.diffusion import diffusion_loss, draw, make_schedule

    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 3, 3, padding=1)
    model.num_classes = 0
    cfg = DiffusionConfig()
    sched = make_schedule(cfg, 8)
    x = torch.randn(4, 3, 8, 8)
    d = draw(4, (3, 8, 8), cfg, sched.T, torch.Generator().manual_seed(1))
    plain = diffusion_loss(lambda a, t, y: model(a), x, None, sched, cfg, draws=d)
    d.weight = torch.tensor([1.0, 1.0, 0.25, 0.25])  # 2 instance, 2 prior images
    weighted = diffusion_loss(lambda a, t, y: model(a), x, None, sched, cfg, draws=d)
    p = plain.per_sample
    torch.testing.assert_close(weighted.loss, (p[0] + p[1] + 0.25 * (p[2] + p[3])) / 4)
    torch.testing.assert_close(d[2:].weight, torch.tensor([0.25, 0.25]))  # sliced alike


def test_prior_preservation_run_resumes_exactly(sd_dir, tmp_path):
    train, reg = kohya_tree(tmp_path)
    fixed = (f"data.reg_path={reg}", "data.prior_loss_weight=0.3", "train.batch_size=4",
             "optim.schedule=constant", "train.checkpoint_every=2",
             f"data.cache_dir={tmp_path / 'cache'}")
    a = steadydiff.train(sd_config(sd_dir, train, *fixed, "train.epochs=1"),
                         out_dir=tmp_path / "straight")
    steadydiff.train(sd_config(sd_dir, train, *fixed, "train.steps=2"),
                     out_dir=tmp_path / "resumed")
    b = steadydiff.train(sd_config(sd_dir, train, *fixed, "train.epochs=1"),
                         out_dir=tmp_path / "resumed")
    assert a.steps == b.steps == 6 and b.resumed_from is not None
    ca = ckpt.load_checkpoint(a.checkpoint, "cpu", weights_only=True)
    cb = ckpt.load_checkpoint(b.checkpoint, "cpu", weights_only=True)
    for k in ca.model:
        assert torch.equal(ca.model[k], cb.model[k]), k


def test_class_images_are_generated_once_and_cached(sd_dir, tmp_path, stream, capsys):
    from steadydiff.integrations.sd.dreambooth import MANIFEST

    inst = images(tmp_path / "dog", 2, (200, 30, 30))
    cls = tmp_path / "cls"
    fixed = (f"data.reg_path={cls}", "data.num_class_images=3", "data.instance_prompt=sks dog",
             "data.class_prompt=a dog", "train.steps=2", "train.batch_size=2",
             "train.checkpoint_every=0")
    steadydiff.train(sd_config(sd_dir, inst, *fixed), out_dir=tmp_path / "a")
    made = sorted(p.name for p in cls.glob("*.png"))
    assert made == ["class_00000.png", "class_00001.png", "class_00002.png"]
    assert "generating 3 from the base model with 'a dog'" in capsys.readouterr().out
    assert Image.open(cls / made[0]).size == (32, 32)
    assert any(s.startswith("cls/class_") for s in stream)  # trained on as regularization
    before = {p: p.read_bytes() for p in cls.glob("*.png")}
    steadydiff.train(sd_config(sd_dir, inst, *fixed), out_dir=tmp_path / "b")
    assert "none generated" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in cls.glob("*.png")} == before  # cached, untouched
    assert '"prompt": "a dog"' in (cls / MANIFEST).read_text()
    with pytest.raises(DataError, match="drawn with prompt 'a dog'"):
        steadydiff.train(sd_config(sd_dir, inst, *fixed[:-3], "data.class_prompt=a cat",
                                   "train.steps=1"), out_dir=tmp_path / "c")


def test_dry_run_prints_what_it_understood(sd_dir, tmp_path, capsys):
    from steadydiff.cli import main

    train, reg = kohya_tree(tmp_path)
    sets = [f"model.pretrained={sd_dir}", f"data.path={train}", f"data.reg_path={reg}",
            "data.image_size=32", "train.batch_size=4", "train.epochs=3", "train.device=cpu",
            "train.precision=fp32", "train.checkpoint_every_epochs=2"]
    assert main(["train", "configs/sd_lora.yaml", "--dry-run",
                 *[x for s in sets for x in ("--set", s)]]) == 0
    out = capsys.readouterr()
    assert "epoch: 22 samples = 6 steps of batch 4" in out.err
    assert "train.epochs=3: 3 x 22 samples / batch 4 = 17 steps" in out.err
    assert "steps: 17" in out.out
    assert "train.checkpoint_every_epochs=2: a checkpoint (and its numbered LoRA files) every " \
        "11 steps" in out.err and "checkpoint_every: 11" in out.out


def test_repeat_folders_with_buckets_keep_each_batch_in_one_bucket(sd_dir, tmp_path):
    """kohya's enable_bucket with repeat folders: each image in its bucket, each batch one
    bucket, each image its repeats per epoch."""
    from steadydiff.data.buckets import bucket_layout

    wide, square = tmp_path / "d" / "2_wide", tmp_path / "d" / "1_square"
    for folder, size in ((wide, (64, 32)), (square, (32, 32))):
        folder.mkdir(parents=True)
        for i in range(2):
            im = np.full((size[1], size[0], 3), 240, np.uint8)
            im[4:12, 4 + 3 * i:12 + 3 * i] = (200, 30, 30)
            Image.fromarray(im).save(folder / f"im{i}.png")
    batches: list[list[int]] = []
    real = loop.make_loader

    def buckets_seen(dataset, **kw):
        lay = bucket_layout(dataset)
        for batch in real(dataset, **kw):
            batches.append([lay.ids[int(i)] for i in batch[2]])
            yield batch

    loop.make_loader = buckets_seen
    try:
        res = steadydiff.train(sd_config(
            sd_dir, tmp_path / "d", "data.buckets=true", "data.bucket_step=8",
            "data.bucket_min_side=16", "data.bucket_max_side=64", "data.bucket_max_ratio=2",
            "train.batch_size=2", "train.epochs=2", "train.checkpoint_every=0"),
            out_dir=tmp_path / "run")
    finally:
        loop.make_loader = real
    assert res.steps == 6  # (2 x 2 + 2 x 1) x 2 epochs / 2
    assert batches and all(len(set(b)) == 1 for b in batches)
    assert len({b[0] for b in batches}) == 2  # both buckets trained


def test_a_quarantined_sample_leaves_with_all_its_repeats():
    """The guard quarantines a dataset index; with repeats, every position of that image is
    excluded from the stream, and an epoch is the rest."""
    from steadydiff.data import StreamBatchSampler
    from steadydiff.data.kohya import Repeated

    class Encoded(torch.utils.data.Dataset):  # 3 images, as EncodedDataset indexes them
        def __len__(self):
            return 3

        def source_index(self, p):
            return p

    r = Repeated(Encoded(), [3, 1, 2], torch.tensor([1.0, 1.0, 0.5]))
    assert len(r) == 6 and r.loss_weights.tolist() == [1, 1, 1, 1, 0.5, 0.5]
    gone = r.copies({1})  # position 1: image 0's second copy
    assert gone == {0, 1, 2}
    s = StreamBatchSampler(len(r), 3, seed=0, exclude=gone)
    assert s.epoch_len == 3 and set(s.permutation(0).tolist()) == {3, 4, 5}
