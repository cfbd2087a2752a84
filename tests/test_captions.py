"""Caption contracts: kohya .txt and Hugging Face metadata.jsonl beside a folder's images,
every bad input named with its file (and line), and class-name captions that are a pure
function of (seed, item).

Every image is generated in tmp_path with Pillow; nothing is downloaded.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from steadydiff.config import DataConfig
from steadydiff.data import (
    ClassSubset, DataError, DigitsDataset, ImageFolderDataset, build_dataset, source_of,
)
from steadydiff.data.captions import (
    CLASS_NAMES, PHRASINGS, CaptionedImageFolder, ClassCaptions, build_captioned, phrase,
    prompt_for, read_captions,
)


def _img(path: Path, color=(200, 30, 90)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), color).save(path)
    return path


def _jsonl(path: Path, *lines: object) -> Path:
    """A metadata.jsonl; dicts are dumped, strings written as they are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n"
                            for x in lines), encoding="utf-8")
    return path


def _folder(root: Path, **kw) -> ImageFolderDataset:
    return ImageFolderDataset(root, image_size=8, channels=3, **kw)


def _read(root: Path, source="auto", missing="error", **kw) -> list[str]:
    ds = _folder(root, **kw)
    return read_captions(ds.root, ds.paths, source, missing)


@pytest.fixture
def three(tmp_path) -> Path:
    """a.png, b.jpg, c.png in one folder, no captions yet."""
    root = tmp_path / "data"
    for n, c in (("a.png", (255, 0, 0)), ("b.jpg", (0, 255, 0)), ("c.png", (0, 0, 255))):
        _img(root / n, c)
    return root


# --------------------------------------------------------------------------- conventions


def test_txt_beside_each_image(three):
    (three / "a.txt").write_bytes("\ufeff  a red square \n".encode())  # BOM, spaces
    (three / "b.txt").write_text("a green\nsquare\r\n\r\non white\n", encoding="utf-8")
    (three / "c.txt").write_text("", encoding="utf-8")  # empty: the empty caption
    assert _read(three, "txt") == ["a red square", "a green square on white", ""]


def test_metadata_jsonl(three):
    _jsonl(three / "metadata.jsonl",
           {"file_name": "c.png", "text": "blue", "extra": 3},  # other keys ignored
           "",  # blank lines skipped
           {"file_name": "./a.png", "text": "red"},
           {"file_name": "b.jpg", "caption": "green"})  # 'caption' when no 'text'
    assert _read(three, "jsonl") == ["red", "green", "blue"]


def test_metadata_jsonl_with_bom(three):
    body = "".join(json.dumps({"file_name": n, "text": n[0]}) + "\n"
                   for n in ("a.png", "b.jpg", "c.png"))
    (three / "metadata.jsonl").write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert _read(three, "jsonl") == ["a", "b", "c"]


def test_auto_takes_txt_first_then_jsonl(three):
    (three / "a.txt").write_text("from txt", encoding="utf-8")
    _jsonl(three / "metadata.jsonl", {"file_name": "a.png", "text": "from jsonl a"},
           {"file_name": "b.jpg", "text": "from jsonl b"}, {"file_name": "c.png", "text": "c"})
    assert _read(three, "auto") == ["from txt", "from jsonl b", "c"]
    # Each explicit source reads its own convention only.
    assert _read(three, "jsonl") == ["from jsonl a", "from jsonl b", "c"]
    with pytest.raises(DataError, match="2 of 3 images have no caption"):
        _read(three, "txt")
    ds = CaptionedImageFolder(_folder(three), "auto")
    assert ds.describe() == (f"CaptionedImageFolder {three}: 3 images 3×8×8, captions from "
                             ".txt (1) and metadata.jsonl (2)")


def test_sub_folders_and_class_labels(tmp_path):
    root = tmp_path / "pets"
    _img(root / "cat" / "1.png")
    _img(root / "cat" / "2.png")
    _img(root / "dog" / "deep" / "1.png")
    _img(root / "dog" / "2.png")
    # HF: a metadata.jsonl's file_name is relative to its own folder; the root's may name
    # images in sub-folders.
    _jsonl(root / "metadata.jsonl", {"file_name": "cat/1.png", "text": "cat one"})
    _jsonl(root / "cat" / "metadata.jsonl", {"file_name": "2.png", "text": "cat two"})
    _jsonl(root / "dog" / "metadata.jsonl", {"file_name": "deep/1.png", "text": "dog one"})
    (root / "dog" / "2.txt").write_text("dog two", encoding="utf-8")
    ds = _folder(root, class_labels=True)
    assert ds.labels == [0, 0, 1, 1]
    assert read_captions(ds.root, ds.paths, "auto", "error") == \
        ["cat one", "cat two", "dog two", "dog one"]
    cap = CaptionedImageFolder(ds, "auto")
    assert cap.num_classes == 0 and cap.captions == ["cat one", "cat two", "dog two", "dog one"]
    # Paths given resolved, with a root that is a symlink to the folder: still matched.
    link = tmp_path / "link"
    link.symlink_to(root)
    assert read_captions(link, [p.resolve() for p in ds.paths], "jsonl", "empty")[:2] == \
        ["cat one", "cat two"]


# --------------------------------------------------------------------------- missing


def test_missing_caption_is_an_error_naming_the_files(tmp_path):
    root = tmp_path / "many"
    for k in range(8):
        _img(root / f"img{k}.png")
    (root / "img0.txt").write_text("zero", encoding="utf-8")
    with pytest.raises(DataError) as e:
        _read(root, "auto")
    msg = str(e.value)
    assert "7 of 8 images have no caption" in msg
    assert "img1.png" in msg and "img5.png" in msg and "img6.png" not in msg
    assert "and 2 more" in msg
    assert "img1.txt" in msg and "metadata.jsonl" in msg and "data.missing_caption=empty" in msg
    # jsonl alone: the hint says no metadata.jsonl exists at all.
    with pytest.raises(DataError, match="none found under"):
        _read(root, "jsonl")


def test_missing_caption_empty_warns(three, caplog):
    (three / "b.txt").write_text("green", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="steadydiff.data.captions"):
        ds = CaptionedImageFolder(_folder(three), "txt", "empty")
    assert ds.captions == ["", "green", ""]
    assert any("2 of 3 images have no caption" in r.getMessage() for r in caplog.records)
    assert "without (empty caption)" in ds.describe()


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("line, match", [
    ('{"file_name": "b.jpg", "text": "x"', r"metadata\.jsonl:2: not valid JSON"),
    ('["b.jpg", "x"]', r"metadata\.jsonl:2: a JSON list, not an object"),
    ('{"name": "b.jpg", "text": "x"}', r"metadata\.jsonl:2: no \"file_name\" key"),
    ('{"file_name": "b.jpg", "label": "x"}',
     r"metadata\.jsonl:2: no caption key .* valid caption keys are 'text' or 'caption'"),
    ('{"file_name": "b.jpg", "text": 3}', r"metadata\.jsonl:2: \"text\" is a JSON int"),
    ('{"file_name": 7, "text": "x"}', r"metadata\.jsonl:2: \"file_name\" is 7"),
    ('{"file_name": "bb.jpg", "text": "x"}', r"metadata\.jsonl:2: 'bb.jpg': no such file \(a typo"),
    ('{"file_name": "notes.md", "text": "x"}', r"metadata\.jsonl:2: 'notes.md': not an image"),
    ('{"file_name": "a.png", "text": "other"}',
     r"metadata\.jsonl:2: 'a.png' is captioned 'other' here but 'red' at .*metadata\.jsonl:1"),
])
def test_bad_metadata_line_names_file_and_line(three, line, match):
    (three / "notes.md").write_text("not an image", encoding="utf-8")
    _jsonl(three / "metadata.jsonl", {"file_name": "a.png", "text": "red"}, line,
           {"file_name": "c.png", "text": "blue"})
    with pytest.raises(DataError, match=match):
        _read(three, "auto", "empty")


def test_duplicate_entry_with_the_same_text_is_fine(three):
    _jsonl(three / "metadata.jsonl", {"file_name": "a.png", "text": "red"},
           {"file_name": "a.png", "text": "red"}, {"file_name": "b.jpg", "text": "g"},
           {"file_name": "c.png", "text": "b"})
    assert _read(three, "jsonl") == ["red", "g", "b"]


def test_entry_for_an_image_dropped_as_unreadable_is_ignored(three):
    (three / "d.png").write_bytes(b"not a png at all" * 4)  # dropped by the folder
    _jsonl(three / "metadata.jsonl", *({"file_name": n, "text": n[0]}
                                       for n in ("a.png", "b.jpg", "c.png", "d.png")))
    ds = _folder(three)
    assert str(three / "d.png") in ds.bad_paths
    assert CaptionedImageFolder(ds, "jsonl").captions == ["a", "b", "c"]
    # Without the folder's bad list, the entry is unknown and the message says why it may be.
    with pytest.raises(DataError, match="'d.png': not among the folder's images"):
        read_captions(ds.root, ds.paths, "jsonl")


def test_non_utf8_txt_names_file_and_offset(three):
    (three / "a.txt").write_text("ok", encoding="utf-8")
    (three / "b.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"b\.txt: caption file is not valid UTF-8 \(byte "
                                        r"offset 3, .*re-save it as UTF-8"):
        _read(three, "txt", "empty")


def test_non_utf8_jsonl_names_file_and_line(three):
    body = (json.dumps({"file_name": "a.png", "text": "a"}) + "\n").encode() + \
        '{"file_name": "b.jpg", "text": "na\xefve"}\n'.encode("latin-1")
    (three / "metadata.jsonl").write_bytes(body)
    with pytest.raises(DataError, match=r"metadata\.jsonl: the metadata file is not valid UTF-8 "
                                        r"\(byte offset \d+, line 2"):
        _read(three, "jsonl", "empty")


def test_unreadable_caption_file(three):
    # A folder where the caption file should be: unreadable whoever runs the test (a chmod
    # 000 file is still readable by root).
    (three / "a.txt").mkdir()
    with pytest.raises(DataError, match=r"a\.txt: the caption file is a folder, not a regular"):
        _read(three, "txt", "empty")


def test_unknown_source_is_refused(three):
    with pytest.raises(DataError, match="valid: auto, txt, jsonl"):
        _read(three, "class_names")


# --------------------------------------------------------------------------- folder dataset


def test_captioned_folder_items_and_forwarded_attributes(three):
    for n in ("a", "b", "c"):
        (three / f"{n}.txt").write_text(f"caption {n}", encoding="utf-8")
    folder = _folder(three)
    ds = CaptionedImageFolder(folder, "txt")
    assert len(ds) == 3 and ds.channels == 3 and ds.image_size == 8 and ds.skipped == 0
    x, c = ds[1]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and c == "caption b"
    assert torch.equal(x, folder[1][0])
    assert ds.path_of(2) == three / "c.png" and ds.paths == folder.paths
    assert source_of(ds, 1) == str(three / "b.jpg")


def test_replaced_image_brings_its_own_caption(three):
    # A noisy JPEG cut short passes the header check and fails to decode: the folder
    # replaces it by the next image, and the caption must follow the image.
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "JPEG", quality=95)
    (three / "b.jpg").write_bytes(buf.getvalue()[: buf.tell() * 6 // 10])
    for n in ("a", "b", "c"):
        (three / f"{n}.txt").write_text(f"caption {n}", encoding="utf-8")
    ds = CaptionedImageFolder(_folder(three), "txt")
    x, c, bad = ds.fetch(1)
    assert bad and c == "caption c" and torch.equal(x, ds[2][0])
    assert ds.fetch(0)[1:] == ("caption a", False)
    assert str(three / "b.jpg") in ds.bad_paths and ds.skipped == 1


# --------------------------------------------------------------------------- class names


class _LabelsOnly(Dataset):
    """Labels without images: any image access fails the test."""

    def __init__(self, labels: list[int], num_classes: int = 10) -> None:
        self.labels = torch.tensor(labels)
        self.num_classes, self.channels, self.image_size = num_classes, 1, 8

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        raise AssertionError("an image was loaded")


def test_class_captions_without_loading_images():
    labels = [k % 10 for k in range(1000)]
    ds = ClassCaptions(_LabelsOnly(labels), CLASS_NAMES["fashion_mnist"], seed=3)
    assert len(ds.captions) == 1000 and ds.num_classes == 0
    assert torch.equal(ds.labels, torch.tensor(labels))
    for name in CLASS_NAMES["fashion_mnist"]:  # all ten names appear
        assert any(c.endswith(name) for c in ds.captions), name
    for c, y in zip(ds.captions, labels):
        assert c.endswith(CLASS_NAMES["fashion_mnist"][y])
    # Every phrasing is used, each caption is one of its class's phrasings.
    assert {ds.caption_for(9, k) for k in range(len(PHRASINGS))} == {
        "a photo of an ankle boot", "an ankle boot", "a picture of an ankle boot", "ankle boot",
        "a black and white photo of an ankle boot"}
    assert set(ds.captions) == {ds.caption_for(y, k) for y in range(10)
                                for k in range(len(PHRASINGS))}


def test_class_captions_are_deterministic_per_seed_and_item():
    digits = DigitsDataset(8, 1)
    a = ClassCaptions(digits, CLASS_NAMES["digits"], seed=0)
    b = ClassCaptions(digits, CLASS_NAMES["digits"], seed=0)
    c = ClassCaptions(digits, CLASS_NAMES["digits"], seed=1)
    assert a.captions == b.captions and a.captions != c.captions
    x, cap = a[7]
    assert torch.equal(x, digits[7][0]) and cap == a.captions[7]
    assert cap.endswith(CLASS_NAMES["digits"][int(digits.labels[7])])
    assert a.channels == 1 and a.image_size == 8
    # The phrasing of item i depends on (seed, i), not on the dataset's length.
    short = ClassCaptions(_LabelsOnly(digits.labels[:50].tolist()), CLASS_NAMES["digits"])
    assert short.captions == a.captions[:50]
    assert "10 class names in 5 phrasings" in a.describe() and "digits: 1797" in a.describe()


def test_class_captions_through_a_class_subset():
    digits = DigitsDataset(8, 1)
    sub = ClassSubset(digits, [3, 8])
    ds = ClassCaptions(sub, CLASS_NAMES["digits"], seed=0)
    assert len(ds) == len(sub) and ds.labels.tolist() == sub.labels
    assert all(c.endswith(("three", "eight")) for c in ds.captions)
    assert any(c.endswith("an eight") for c in ds.captions)


def test_class_captions_refuse_bad_inputs():
    with pytest.raises(DataError, match="3 class names for a dataset of 10 classes"):
        ClassCaptions(_LabelsOnly([0, 1]), ("a", "b", "c"))
    with pytest.raises(DataError, match="label 12 has no class name"):
        ClassCaptions(_LabelsOnly([0, 12], num_classes=0), CLASS_NAMES["digits"])
    with pytest.raises(DataError, match="templates with"):
        ClassCaptions(_LabelsOnly([0]), CLASS_NAMES["digits"], phrasings=("a photo",))


def test_articles_and_prompts():
    assert prompt_for("fashion_mnist", 9) == "a photo of an ankle boot"
    assert prompt_for("fashion_mnist", 0) == "a photo of a T-shirt/top"
    assert prompt_for("digits", 8) == "a photo of an eight"
    assert prompt_for("digits", 1) == "a photo of a one"
    assert phrase("A {} on a table", "apple") == "An apple on a table"
    assert phrase("{}", "eight") == "eight"
    with pytest.raises(DataError, match="0..9"):
        prompt_for("digits", 10)
    with pytest.raises(DataError, match="no class names for dataset 'folder'"):
        prompt_for("folder", 0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("source", ["txt", "jsonl", "auto"])
def test_build_captioned_folder(three, source):
    for n in ("a", "b", "c"):
        (three / f"{n}.txt").write_text(f"txt {n}", encoding="utf-8")
    _jsonl(three / "metadata.jsonl", *({"file_name": n, "text": f"jsonl {n[0]}"}
                                       for n in ("a.png", "b.jpg", "c.png")))
    cfg = DataConfig(dataset="folder", path=str(three), image_size=8, channels=3,
                     captions=source)
    ds = build_captioned(cfg, build_dataset(cfg))
    assert isinstance(ds, CaptionedImageFolder)
    kind = "jsonl" if source == "jsonl" else "txt"
    assert ds.captions == [f"{kind} a", f"{kind} b", f"{kind} c"]


def test_build_captioned_none_and_class_names():
    cfg = DataConfig(dataset="digits", image_size=8)
    data = build_dataset(cfg)
    assert build_captioned(cfg, data) is data
    cfg = DataConfig(dataset="digits", image_size=8, captions="class_names")
    ds = build_captioned(cfg, data, seed=5)
    assert isinstance(ds, ClassCaptions)
    assert ds.captions == ClassCaptions(data, CLASS_NAMES["digits"], seed=5).captions


def test_build_captioned_folder_class_subset(tmp_path):
    root = tmp_path / "pets"
    _img(root / "cat" / "1.png")
    _img(root / "dog" / "1.png")
    _img(root / "dog" / "2.png")
    (root / "dog" / "1.txt").write_text("dog one", encoding="utf-8")
    (root / "dog" / "2.txt").write_text("dog two", encoding="utf-8")
    # The cat has no caption, but data.classes leaves it out: no error.
    cfg = DataConfig(dataset="folder", path=str(root), image_size=8, channels=3,
                     class_labels=True, classes=(1,), captions="txt")
    ds = build_captioned(cfg, build_dataset(cfg))
    assert isinstance(ds, CaptionedImageFolder) and ds.captions == ["dog one", "dog two"]
    assert source_of(ds, 0) == str(root / "dog" / "1.png") and ds[1][1] == "dog two"


def test_build_captioned_refuses_files_for_a_non_folder():
    cfg = DataConfig(dataset="digits", image_size=8)
    with pytest.raises(DataError, match="reads caption files beside the images of a folder"):
        build_captioned(cfg.model_copy(update={"captions": "txt"}), build_dataset(cfg))


# ------------------------------------------------------------ tag shuffle, dropout, trigger

from steadydiff.data.captions import (  # noqa: E402
    CaptionVariants, overflow_message, split_tags, token_overflow, with_trigger,
)

TAGS = "sks, dog, red collar, grass, sunny, park, running, bokeh"


def test_shuffle_keeps_the_first_tags_and_permutes_the_rest_per_epoch():
    v = CaptionVariants(seed=7, shuffle=True, keep_tokens=2)
    tags = split_tags(TAGS)
    seen = set()
    for e in range(6):
        out = split_tags(v(TAGS, 3, e))
        assert out[:2] == tags[:2]  # kept in place
        assert sorted(out[2:]) == sorted(tags[2:]) and len(out) == len(tags)
        assert v(TAGS, 3, e) == CaptionVariants(seed=7, shuffle=True, keep_tokens=2)(TAGS, 3, e)
        seen.add(tuple(out))
    assert len(seen) >= 5  # differs across epochs
    assert v(TAGS, 3, 0) != CaptionVariants(seed=8, shuffle=True, keep_tokens=2)(TAGS, 3, 0) \
        or v(TAGS, 3, 1) != CaptionVariants(seed=8, shuffle=True, keep_tokens=2)(TAGS, 3, 1)
    assert CaptionVariants(seed=7)(TAGS, 3, 0) == TAGS  # off: unchanged
    assert CaptionVariants(seed=7, shuffle=True, keep_tokens=8)(TAGS, 3, 0) == TAGS


def test_caption_dropout_rate_and_reproducibility():
    v = CaptionVariants(seed=1, dropout=0.2)
    drops = [v.dropped(i, e) for i in range(500) for e in range(4)]
    assert 0.17 < sum(drops) / len(drops) < 0.23
    assert drops == [CaptionVariants(seed=1, dropout=0.2).dropped(i, e)
                     for i in range(500) for e in range(4)]
    assert v("a dog", 0, 0) in ("", "a dog")
    assert not any(CaptionVariants(seed=1).dropped(i, 0) for i in range(100))


def test_trigger_is_prepended_once_and_stays_first_under_shuffle():
    assert with_trigger("a dog, grass", "sks") == "sks, a dog, grass"
    assert with_trigger("sks, a dog", "sks") == "sks, a dog"
    assert with_trigger("sksdog, grass", "sks") == "sks, sksdog, grass"
    assert with_trigger("", "sks") == "sks"
    assert with_trigger("a | b", "sks", "|") == "sks| a| b"
    v = CaptionVariants(seed=0, shuffle=True, keep_tokens=1, trigger="sks")
    for e in range(5):
        out = split_tags(v(TAGS, 0, e))
        assert out[:2] == ["sks", "dog"]


def test_token_overflow_names_the_files():
    caps = ["short", "w " * 100, "short", "x " * 90]
    over = token_overflow(caps, lambda cs: [len(c.split()) + 2 for c in cs], 77,
                          ["a.png", "b.png", "c.png", "d.png"])
    assert over == [("b.png", 102), ("d.png", 92)]
    msg = overflow_message(over, 77, 4)
    assert "b.png (102 tokens)" in msg and "2 of 4" in msg and "77" in msg


def test_caption_options_are_validated():
    from steadydiff.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.caption_shuffle"):
        load_config(None, ["data.caption_shuffle=true"])
    with pytest.raises(ConfigError, match="data.trigger"):
        load_config(None, ["data.trigger=sks"])
    with pytest.raises(ConfigError, match="caption_dropout"):
        load_config(None, ["data.dataset=fashion_mnist", "data.captions=class_names",
                           "data.caption_dropout=1.5"])


def test_trigger_reaches_class_name_captions():
    from steadydiff.config import DataConfig
    from steadydiff.data.captions import ClassCaptions, build_captioned

    class Labelled(Dataset):
        labels = torch.tensor([0, 1, 2])
        num_classes = 10
        channels, image_size = 1, 8

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.zeros(1, 8, 8), int(self.labels[i])

    cfg = DataConfig(dataset="digits", captions="class_names", trigger="sks")
    ds = build_captioned(cfg, Labelled(), seed=0)
    assert isinstance(ds, ClassCaptions)
    assert all(c.startswith("sks, ") for c in ds.captions)
    assert ds[1][1].startswith("sks, ") and ds[1][1] == ds.captions[1]


# --------------------------------------------------------------------------- untrusted files
# Caption files obey the data-folder rules images obey (issue 28, items 7 and 8).


def test_caption_symlinked_outside_the_folder_is_refused_by_name(three, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the contents of a private file")
    for n in ("a", "b", "c"):
        (three / f"{n}.txt").write_text(f"a {n}")
    (three / "b.txt").unlink()
    (three / "b.txt").symlink_to(secret)
    with pytest.raises(DataError, match=r"b\.txt.*symlink.*outside the data folder"):
        _read(three)
    # data.follow_symlinks opens the door for captions as it does for images
    captioned = CaptionedImageFolder(_folder(three, follow_symlinks=True))
    assert captioned.captions[1] == "the contents of a private file"
    ds = _folder(three, follow_symlinks=True)
    assert read_captions(ds.root, ds.paths, "txt", follow_symlinks=True)[1].startswith("the")


def test_caption_symlink_inside_the_folder_is_read(three):
    (three / "shared").mkdir()
    (three / "shared" / "cap.txt").write_text("a shared caption")
    for n in ("a", "b", "c"):
        (three / f"{n}.txt").symlink_to(three / "shared" / "cap.txt")
    assert _read(three, "txt") == ["a shared caption"] * 3


def _in_thread(fn, seconds: float = 10.0):
    """``fn()``'s exception (or None), failing the test if it has not returned in time."""
    import threading
    box: list = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still reading after {seconds} s (blocked on a FIFO?)"
    return box[0]


def test_fifo_caption_is_refused_without_hanging(three):
    import os
    for n in ("a", "c"):
        (three / f"{n}.txt").write_text(f"a {n}")
    os.mkfifo(three / "b.txt")  # no writer: a plain open() would block forever
    err = _in_thread(lambda: _read(three))
    assert isinstance(err, DataError)
    assert "b.txt" in str(err) and "FIFO" in str(err) and "regular file" in str(err)


def test_fifo_metadata_jsonl_is_refused_without_hanging(three):
    import os
    os.mkfifo(three / "metadata.jsonl")
    err = _in_thread(lambda: _read(three, "jsonl"))
    assert isinstance(err, DataError) and "metadata.jsonl" in str(err) and "FIFO" in str(err)


def test_dev_zero_caption_is_refused_without_reading_it(three):
    import os
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    for n in ("a", "c"):
        (three / f"{n}.txt").write_text(f"a {n}")
    (three / "b.txt").symlink_to("/dev/zero")
    with pytest.raises(DataError, match=r"b\.txt.*outside the data folder"):
        _read(three)
    # followed on request, it is still a device, not a caption: refused before any read
    err = _in_thread(lambda: CaptionedImageFolder(_folder(three, follow_symlinks=True)), 10.0)
    assert isinstance(err, DataError) and "character device" in str(err)


def test_oversized_caption_file_is_refused_by_name(three):
    from steadydiff.data.captions import CAPTION_MAX_BYTES
    (three / "a.txt").write_text("a " * (CAPTION_MAX_BYTES // 2))  # exactly the limit
    (three / "c.txt").write_text("c")
    (three / "b.txt").write_text("x" * (10 * 2**20))  # 10 MB
    with pytest.raises(DataError, match=r"b\.txt.*10,485,760 bytes.*limited to 8,192"):
        _read(three)
    (three / "b.txt").write_text("b")
    assert len(_read(three)[0]) == CAPTION_MAX_BYTES - 1  # stripped of its last space


def test_oversized_metadata_entry_is_refused_with_its_line(three):
    from steadydiff.data.captions import CAPTION_MAX_BYTES
    _jsonl(three / "metadata.jsonl", {"file_name": "a.png", "text": "ok"},
           {"file_name": "b.png", "text": "é" * CAPTION_MAX_BYTES},  # 2 bytes a character
           {"file_name": "c.png", "text": "ok"})
    with pytest.raises(DataError, match=r"metadata\.jsonl:2: the caption is 16,384 bytes"):
        _read(three, "jsonl")


def test_metadata_jsonl_symlinked_outside_is_refused(three, tmp_path):
    outside = _jsonl(tmp_path / "elsewhere.jsonl", {"file_name": "a.png", "text": "x"})
    (three / "metadata.jsonl").symlink_to(outside)
    with pytest.raises(DataError, match=r"metadata\.jsonl.*symlink.*outside the data folder"):
        _read(three, "jsonl", missing="empty")


def test_token_overflow_counts_a_bounded_prefix():
    from steadydiff.data.captions import CAPTION_MAX_BYTES
    seen: list[int] = []

    def count(cs):
        seen.extend(len(c) for c in cs)
        return [len(c.split()) + 2 for c in cs]
    over = token_overflow(["w " * 2_000_000, "short"], count, 77, ["big.png", "s.png"])
    assert max(seen) <= CAPTION_MAX_BYTES
    assert over and over[0][0] == "big.png" and over[0][1] > 77
