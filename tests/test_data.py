"""Data layer contracts: datasets, bad input, and the exactly replayable batch stream.

Every image is generated in tmp_path with Pillow; nothing is downloaded.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset, TensorDataset

from steadydiff.config import DataConfig
from steadydiff.data import (
    DataError,
    DigitsDataset,
    ImageFolderDataset,
    SeededView,
    StreamBatchSampler,
    as_pairs,
    build_dataset,
    check_label,
    check_labels,
    make_loader,
)


def _img(path: Path, size: tuple[int, int] = (20, 12), color=(200, 30, 90),
         mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fill = color if mode == "RGB" else color[0]
    Image.new(mode, size, fill).save(path)
    return path


# --------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits() -> DigitsDataset:
    return DigitsDataset(image_size=16, channels=1)


def test_digits_shape_range_labels(digits):
    assert len(digits) == 1797
    assert digits.num_classes == 10 and digits.channels == 1 and digits.image_size == 16
    x, y = digits[5]
    assert x.shape == (1, 16, 16) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.ndim == 0
    assert digits.images.min() >= -1.0 and digits.images.max() <= 1.0
    assert digits.images.min() == -1.0  # the background is exactly black
    assert sorted(digits.labels.unique().tolist()) == list(range(10))
    assert digits.describe() == "digits: 1797 images 1×16×16, 10 classes"


def test_digits_rgb_and_downsample():
    d = DigitsDataset(image_size=4, channels=3)
    x, _ = d[0]
    assert x.shape == (3, 4, 4)
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    with pytest.raises(DataError, match="channels"):
        DigitsDataset(channels=2)  # type: ignore[arg-type]


def test_digits_large_sizes_resize_on_access(monkeypatch, digits):
    monkeypatch.setattr(DigitsDataset, "PRECOMPUTE_BYTES", 0)
    lazy = DigitsDataset(image_size=16, channels=3)
    assert lazy._resized is None
    for i in (0, 17, -1):
        x, y = lazy[i]
        assert x.shape == (3, 16, 16) and torch.equal(x[2], digits[i][0][0])
        assert torch.equal(y, digits[i][1])


def test_build_dataset_digits():
    d = build_dataset(DataConfig(dataset="digits", image_size=8, channels=3))
    assert (d.channels, d.image_size, d.num_classes) == (3, 8, 10)
    assert d[0][0].shape == (3, 8, 8)


# --------------------------------------------------------------------------- folder


def test_folder_nested_mixed_formats_and_labels(tmp_path):
    root = tmp_path / "data"
    _img(root / "cat" / "a.png")
    _img(root / "cat" / "deep" / "b.JPG", size=(12, 20))
    _img(root / "dog" / "c.webp")
    _img(root / "dog" / "d.jpeg", mode="L")
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / "cat" / "labels.csv").write_text("a,b")
    _img(root / ".hidden" / "x.png")  # hidden folders are not classes
    (root / "empty").mkdir()  # no images: not a class

    ds = ImageFolderDataset(root, image_size=8, channels=3, class_labels=True)
    assert len(ds) == 4 and ds.skipped == 0
    assert ds.class_names == ["cat", "dog"] and ds.num_classes == 2
    rel = [p.relative_to(root).as_posix() for p in ds.paths]
    assert rel == ["cat/a.png", "cat/deep/b.JPG", "dog/c.webp", "dog/d.jpeg"]
    assert ds.labels == [0, 0, 1, 1]
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == (3, 8, 8) and x.dtype == torch.float32
        assert -1.0 <= x.min() and x.max() <= 1.0
        assert y.dtype == torch.int64 and int(y) == ds.labels[i]
    # A flat red-ish PNG stays that colour: (200, 30, 90) / 127.5 - 1
    x, _ = ds[0]
    assert torch.allclose(x[:, 4, 4], torch.tensor([200, 30, 90]) / 127.5 - 1, atol=1e-6)
    assert "4 images 3×8×8, 2 classes" in ds.describe()

    gray = ImageFolderDataset(root, image_size=6, channels=1)
    assert gray.num_classes == 0 and gray.class_names == []
    assert gray[0][0].shape == (1, 6, 6) and int(gray[0][1]) == 0


def test_folder_center_crop_vs_squash(tmp_path):
    # 40×10, the left quarter black: the center crop (columns 15..25) is all white, squashing
    # the whole image keeps the black quarter in the first column.
    a = np.full((10, 40), 255, np.uint8)
    a[:, :10] = 0
    (tmp_path / "r").mkdir()
    Image.fromarray(a, "L").save(tmp_path / "r" / "wide.png")
    crop = ImageFolderDataset(tmp_path / "r", image_size=4, channels=1)[0][0]
    squash = ImageFolderDataset(tmp_path / "r", image_size=4, channels=1, center_crop=False)[0][0]
    assert crop.shape == squash.shape == (1, 4, 4)
    assert torch.allclose(crop, torch.ones(1, 4, 4))
    assert (squash[0, :, 0] < -0.5).all()  # bicubic blurs the edge a little
    assert torch.allclose(squash[0, :, -1], torch.ones(4))


def test_folder_16bit_and_alpha_conversion(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    # 16-bit gray at mid-range: Image.convert("L") alone would clip it to white.
    Image.fromarray(np.full((8, 8), 32768, np.uint16)).save(root / "a16.png")
    # Fully transparent pixels with black colour are composited onto white.
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(root / "b_alpha.png")
    ds = ImageFolderDataset(root, image_size=4, channels=1)
    assert torch.allclose(ds[0][0], torch.zeros(1, 4, 4), atol=0.01)
    assert torch.allclose(ds[1][0], torch.ones(1, 4, 4))


def test_build_dataset_folder(tmp_path):
    _img(tmp_path / "d" / "a" / "x.png")
    _img(tmp_path / "d" / "b" / "y.jpg")
    ds = build_dataset(DataConfig(dataset="folder", path=str(tmp_path / "d"), image_size=8,
                                  channels=3, class_labels=True))
    assert (ds.num_classes, ds.channels, ds.image_size, len(ds)) == (2, 3, 8, 2)
    assert ds.describe().endswith("2 images 3×8×8, 2 classes")


def test_folder_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="does not exist") as e:
        ImageFolderDataset(missing, 8, 3)
    assert str(missing) in str(e.value) and ".png" in str(e.value)

    f = _img(tmp_path / "file.png")
    with pytest.raises(DataError, match="not a directory") as e:
        ImageFolderDataset(f, 8, 3)
    assert str(f) in str(e.value)

    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "readme.md").write_text("hi")
    with pytest.raises(DataError, match="contains no images") as e:
        ImageFolderDataset(empty, 8, 3)
    assert str(empty) in str(e.value) and ".webp" in str(e.value)

    loose = tmp_path / "loose"
    _img(loose / "a" / "x.png")
    _img(loose / "stray.png")
    with pytest.raises(DataError, match="stray.png"):
        ImageFolderDataset(loose, 8, 3, class_labels=True)

    with pytest.raises(DataError, match="data.path"):
        build_dataset(DataConfig.model_construct(dataset="folder", path=None))


def test_folder_corrupt_files_skipped_and_reported(tmp_path, caplog):
    root = tmp_path / "data"
    _img(root / "a.png")
    _img(root / "c.png", color=(0, 0, 255))
    # A noisy JPEG cut at 60% keeps its headers (the check passes) but loses scan data: the
    # failure shows at load time.
    noise = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "JPEG", quality=95)
    (root / "b_truncated.jpg").write_bytes(buf.getvalue()[: buf.tell() * 6 // 10])
    (root / "garbage.png").write_bytes(b"this is not a png" * 10)  # dropped at construction

    with caplog.at_level(logging.WARNING, logger="steadydiff.data"):
        ds = ImageFolderDataset(root, image_size=8, channels=3)
        assert len(ds) == 3 and ds.skipped == 1
        assert any("garbage.png" in r.getMessage() for r in caplog.records)
        items = [ds[i] for i in range(len(ds))] + [ds[i] for i in range(len(ds))]
    trunc = str(root / "b_truncated.jpg")
    assert trunc in ds.bad_paths and str(root / "garbage.png") in ds.bad_paths
    assert ds.skipped == 2
    # Reported once, though visited twice.
    assert sum(trunc in r.getMessage() for r in caplog.records) == 1
    # Replaced by the next good index (c.png), deterministically.
    i_trunc = [p.name for p in ds.paths].index("b_truncated.jpg")
    assert torch.equal(items[i_trunc][0], ds[i_trunc + 1][0])
    assert all(x.shape == (3, 8, 8) for x, _ in items)


def test_folder_all_bad_is_an_error(tmp_path):
    root = tmp_path / "bad"
    root.mkdir()
    (root / "x.png").write_bytes(b"nope")
    (root / "y.jpg").write_bytes(b"")
    with pytest.raises(DataError, match="unreadable"):
        ImageFolderDataset(root, 8, 3)


def test_folder_refuses_decompression_bombs(tmp_path, monkeypatch, caplog):
    root = tmp_path / "data"
    _img(root / "ok.png", size=(16, 16))  # 256 px
    _img(root / "warn_bomb.png", size=(40, 40))  # 1600 px: over the limit (Pillow warns)
    _img(root / "error_bomb.png", size=(64, 64))  # 4096 px: over 2× the limit (Pillow raises)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with caplog.at_level(logging.WARNING, logger="steadydiff.data"):
        ds = ImageFolderDataset(root, 8, 3)
    assert [p.name for p in ds.paths] == ["ok.png"]
    assert ds.skipped == 2
    assert "decompression bomb" in ds.bad_paths[str(root / "warn_bomb.png")]
    assert "decompression bomb" in ds.bad_paths[str(root / "error_bomb.png")]
    # The process-wide warnings filters are untouched: the warning is still just a warning.
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        Image.open(root / "warn_bomb.png").close()
    assert any(issubclass(x.category, Image.DecompressionBombWarning) for x in w)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_folder_symlinks_outside_root(tmp_path):
    outside = tmp_path / "outside"
    _img(outside / "secret.png")
    _img(outside / "sub" / "deep.png")
    root = tmp_path / "data"
    _img(root / "own.png")
    os.symlink(outside / "secret.png", root / "link.png")
    os.symlink(outside / "sub", root / "linkdir")
    os.symlink(root / "own.png", root / "inside_link.png")  # inside the root: used

    ds = ImageFolderDataset(root, 8, 3)
    assert sorted(p.name for p in ds.paths) == ["inside_link.png", "own.png"]
    assert ds.skipped == 2 and ds.skipped_symlinks == 2

    ds = ImageFolderDataset(root, 8, 3, follow_symlinks=True)
    assert [p.relative_to(root).as_posix() for p in ds.paths] == [
        "inside_link.png", "link.png", "linkdir/deep.png", "own.png"]
    assert ds.skipped == 0


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_folder_symlink_cycles_terminate(tmp_path):
    root = tmp_path / "data"
    _img(root / "a" / "x.png")
    os.symlink(root, root / "a" / "loop")  # inside the root: followed, but scanned once
    outside = tmp_path / "outside"
    _img(outside / "y.png")
    os.symlink(outside, root / "out")
    os.symlink(root, outside / "back")  # outside → root → outside → ...
    os.symlink(root / "a", root / "0_alias")  # sorts first, but the real name wins
    for follow in (False, True):
        ds = ImageFolderDataset(root, 8, 3, class_labels=True, follow_symlinks=follow)
        rel = [p.relative_to(root).as_posix() for p in ds.paths]
        assert rel == (["a/x.png", "out/y.png"] if follow else ["a/x.png"])
        assert ds.class_names == (["a", "out"] if follow else ["a"])


# --------------------------------------------------------------------------- as_pairs


class _ListDataset(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_as_pairs_tensors_and_pairs():
    bare = as_pairs(_ListDataset([torch.zeros(3, 4, 4, dtype=torch.float64)] * 3))
    x, y = bare[1]
    assert x.dtype == torch.float32 and x.shape == (3, 4, 4)
    assert y.dtype == torch.int64 and int(y) == 0
    assert (bare.channels, bare.image_size, bare.num_classes) == (3, 4, 0)
    assert bare.describe() == "_ListDataset: 3 images 3×4×4, unlabeled"

    pairs = as_pairs(_ListDataset([(torch.ones(1, 5, 5), 7), (torch.ones(1, 5, 5),
                                                                torch.tensor([3]))]))
    assert int(pairs[0][1]) == 7 and int(pairs[1][1]) == 3
    assert pairs[1][1].dtype == torch.int64 and pairs[1][1].ndim == 0


@pytest.mark.parametrize("items, match", [
    (["a string"], "dataset item 0 is a str; expected an image tensor"),
    ([(torch.zeros(4, 4), 1)], r"shape \(4, 4\); expected 3 dimensions"),
    ([torch.zeros(1, 4, 4, dtype=torch.uint8)], "dtype torch.uint8"),
    ([(torch.zeros(1, 4, 4), 1.5)], "label is float"),
    ([(torch.zeros(1, 4, 4), 1, "extra")], "tuple of length 3"),
    ([(np.zeros((1, 4, 4)), 1)], "the image is a ndarray"),
    ([], "is empty"),
])
def test_as_pairs_rejects_bad_items(items, match):
    with pytest.raises(DataError, match=match):
        as_pairs(_ListDataset(items))


# --------------------------------------------------------------------------- labels

# model.num_classes=3: ids 0..2 are classes, 3 is the null class of classifier-free guidance
VALID_IDS = "valid class ids are 0..2 (model.num_classes=3; id 3 is reserved for the null class"


@pytest.mark.parametrize("label, said", [
    (3, "label 3 is out of range"),  # the null class id: never accepted from data
    (7, "label 7 is out of range"),
    (-1, "label -1 is out of range"),
    (torch.tensor(4), "label 4 is out of range"),
    (1.5, "the label is float 1.5; expected an integer class id"),
    (torch.tensor(1.0), "the label is Tensor tensor(1.); expected an integer class id"),
    (True, "the label is bool True"),
], ids=["null", "above", "negative", "tensor", "float", "float-tensor", "bool"])
def test_check_label_names_item_label_and_range(label, said):
    with pytest.raises(DataError) as e:
        check_label(label, 3, "dataset item 5")
    assert str(e.value).startswith(f"dataset item 5: {said}") and VALID_IDS in str(e.value)
    assert check_label(np.int64(2), 3, "x") == 2 and check_label(torch.tensor(0), 3, "x") == 0


def test_labels_read_without_images_are_all_checked_before_training(tmp_path):
    """A dataset with ``labels`` (here a folder's, edited) or a TensorDataset: the first
    bad label is found among all of them, with the file's path for a folder."""
    for name in ["a", "b"]:
        for j in range(2):
            _img(tmp_path / name / f"{j}.png")
    folder = ImageFolderDataset(tmp_path, 4, class_labels=True)
    check_labels(folder, 2)  # its own labels are fine
    folder.labels[3] = 2
    with pytest.raises(DataError, match=r"dataset item 3 \(.*b/1.png\): label 2 is out of range"
                                        r"; valid class ids are 0..1"):
        check_labels(folder, 2)

    images = torch.zeros(40, 1, 4, 4)
    labels = torch.arange(40) % 3
    labels[[17, 30]] = 3  # item 17 is not among the images as_pairs reads at build time
    pairs = as_pairs(TensorDataset(images, labels))
    with pytest.raises(DataError, match=r"dataset item 17: label 3 is out of range; "
                                        r"valid class ids are 0..2 .*\(2 labels out of range\)"):
        check_labels(pairs, 3)
    listed = _ListDataset([(torch.zeros(1, 4, 4), 0)] * 3)
    listed.labels = [0, 1, 0.5]  # a user dataset's own per-item labels
    with pytest.raises(DataError, match=r"dataset item 2: the label is 0.5, not an integer"):
        check_labels(as_pairs(listed), 3)
    listed.labels = ["cat", "dog"]  # class names, not per-item labels: left to the fetch
    check_labels(as_pairs(listed), 3)
    check_labels(pairs, 4)  # 3 is a real class of a 4-class model


def test_labels_are_checked_as_items_are_fetched():
    """A dataset whose labels come only with its images: the label is checked on the CPU as
    the item is fetched (any dataset, ours or a user's), before it could reach the model."""
    items = [(torch.zeros(1, 4, 4), 0)] * 40
    items[17] = (torch.zeros(1, 4, 4), 3)
    view = SeededView(_ListDataset(items), seed=0, num_classes=3)
    assert int(view[(16, 0)][1]) == 0
    with pytest.raises(DataError) as e:
        view[(17, 0)]
    assert str(e.value).startswith(f"dataset item 17: label 3 is out of range; {VALID_IDS}")
    SeededView(_ListDataset(items), seed=0)[(17, 0)]  # unconditional: labels unused
    # as_pairs knows the range too: a bad label among the items it reads is refused at once
    with pytest.raises(DataError, match="dataset item 0: label 5 is out of range"):
        as_pairs(_ListDataset([(torch.zeros(1, 4, 4), 5)]), 3)
    # a folder's items are named with their file
    digits = DigitsDataset(8)
    digits.labels[4] = 10
    with pytest.raises(DataError, match="dataset item 4: label 10 is out of range"):
        next(iter(make_loader(digits, batch_size=1797, seed=0, num_classes=10)))


def test_class_embedder_refuses_bad_labels_on_the_cpu():
    from steadydiff.models import ClassEmbedder

    emb = ClassEmbedder(10, 4)
    assert emb(torch.tensor([0, 9, 10])).shape == (3, 4)  # 10: the null class
    for y, said in [(torch.tensor([3, 11]), "class label 11 is out of range"),
                    (torch.tensor([-1, 2]), "class label -1 is out of range")]:
        with pytest.raises(ValueError, match=f"{said}: valid labels are 0..9, and 10 for the "
                                             "null class"):
            emb(y)
    with pytest.raises(ValueError, match="class labels must be an integer tensor, got "
                                         "torch.float32; valid labels are 0..9"):
        emb(torch.tensor([1.0]))


def test_as_pairs_later_item_shape_mismatch():
    # as_pairs reads items spread over the dataset (the range check), so it may find it first
    with pytest.raises(DataError, match="dataset item 1"):
        as_pairs(_ListDataset([torch.zeros(1, 4, 4), torch.zeros(1, 5, 5)]))[1]


# --------------------------------------------------------------------------- batching


def test_sampler_resume_equals_tail():
    full = StreamBatchSampler(23, 5, seed=3)
    resumed = StreamBatchSampler(23, 5, seed=3, start_batch=7)
    it_full, it_res = iter(full), iter(resumed)
    batches = [next(it_full) for _ in range(20)]
    assert [next(it_res) for _ in range(13)] == batches[7:]
    # Different seed: different stream.
    assert StreamBatchSampler(23, 5, seed=4).batch_indices(0) != batches[0]


def test_sampler_every_index_once_per_epoch():
    n, B = 23, 5  # epoch boundaries fall inside batches
    s = StreamBatchSampler(n, B, seed=0)
    keys = [k for b in range(n * 4 // B + 1) for k in s.batch_indices(b)][: n * 4]
    for e in range(4):
        idx = [i for i, ep in keys if ep == e]
        assert sorted(idx) == list(range(n))
    assert keys[n:2 * n] != keys[:n]  # a fresh permutation each epoch
    assert s.epoch_of(0) == 0 and s.epoch_of(4) == 0 and s.epoch_of(5) == 1  # 25 // 23


def test_sampler_batch_indices_is_pure():
    s = StreamBatchSampler(50, 8, seed=1)
    first = s.batch_indices(30)
    for b in range(40):  # churn the permutation cache
        s.batch_indices(b)
    assert s.batch_indices(30) == first == StreamBatchSampler(50, 8, seed=1).batch_indices(30)


def test_sampler_dataset_smaller_than_batch():
    s = StreamBatchSampler(3, 8, seed=0)
    b0, b1 = s.batch_indices(0), s.batch_indices(1)
    assert len(b0) == len(b1) == 8
    stream = b0 + b1
    for e in range(5):  # positions 0..14 are five whole epochs
        assert sorted(i for i, ep in stream if ep == e) == [0, 1, 2]
    x, y, idx, bad = next(iter(make_loader(DigitsDataset(8), batch_size=4, seed=0)))
    assert x.shape == (4, 1, 8, 8)


def test_sampler_rank_slices_disjoint_and_cover():
    n, B, W = 30, 12, 3
    glob = StreamBatchSampler(n, B, seed=5)
    ranks = [StreamBatchSampler(n, B, seed=5, rank=r, world_size=W) for r in range(W)]
    for b in (0, 1, 2, 9):
        parts = [r.batch_indices(b) for r in ranks]
        assert all(len(p) == B // W for p in parts)
        flat = [k for p in parts for k in p]
        assert flat == glob.batch_indices(b) == ranks[0].global_batch_indices(b)
        assert len(set(flat)) == B  # disjoint
    # uneven: 10 over 3 ranks is 3/3/4, still disjoint, covering, in the global order
    uneven = [StreamBatchSampler(n, 10, seed=5, rank=r, world_size=W) for r in range(W)]
    assert [len(u.batch_indices(4)) for u in uneven] == [3, 3, 4]
    assert [k for u in uneven for k in u.batch_indices(4)] == \
        StreamBatchSampler(n, 10, seed=5).batch_indices(4)
    with pytest.raises(ValueError, match="at least world_size"):
        StreamBatchSampler(n, 2, seed=0, world_size=3)
    with pytest.raises(DataError, match="empty"):
        StreamBatchSampler(0, 4, seed=0)


def _take(loader, k):
    it = iter(loader)
    return [next(it) for _ in range(k)]


def test_seeded_view_flip_is_keyed_not_global(digits):
    view = SeededView(digits, seed=0, hflip=True)
    flips = 0
    for i in range(64):
        x, y, idx, bad = view[(i, 0)]
        assert idx == i and int(y) == int(digits.labels[i])
        if torch.equal(x, digits.images[i].flip(-1)) and not torch.equal(x, digits.images[i]):
            flips += 1
        torch.manual_seed(i)  # the global RNG has no say
        assert torch.equal(view[(i, 0)][0], x)
    assert 16 < flips < 48  # about half
    # Another epoch draws anew: some sample flips differently.
    assert any(not torch.equal(view[(i, 0)][0], view[(i, 1)][0]) for i in range(64))


def test_loader_reproducible_resumable_and_worker_independent(digits):
    kw = dict(batch_size=16, seed=11, hflip=True)
    a = _take(make_loader(digits, **kw), 6)
    torch.manual_seed(123)  # the global RNG must not matter
    b = _take(make_loader(digits, **kw), 6)
    tail = _take(make_loader(digits, start_batch=4, **kw), 2)
    workers = _take(make_loader(digits, num_workers=2, **kw), 6)
    for got in (b, workers):
        for (x1, y1, i1, _), (x2, y2, i2, _) in zip(a, got):
            assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(i1, i2)
    for (x1, _, i1, _), (x2, _, i2, _) in zip(a[4:], tail):
        assert torch.equal(x1, x2) and torch.equal(i1, i2)
    x, y, idx, bad = a[0]
    assert x.shape == (16, 1, 16, 16) and y.shape == (16,) and idx.shape == (16,)
    assert y.dtype == idx.dtype == torch.int64
    # Some images are flipped in the batch (seeded), the rest untouched.
    ref = digits.images[idx]
    assert not torch.equal(x, ref)


def test_loader_does_not_consume_global_rng(digits):
    torch.manual_seed(0)
    _take(make_loader(digits, batch_size=4, seed=0), 1)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))
