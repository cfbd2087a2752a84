"""ControlNet data: (image, conditioning image, caption) triples in the two layouts users have
(a conditioning/ folder, metadata.jsonl's conditioning_image column), every bad pair an error
naming both files, the conditioning image prepared like its image (center crop, bucket crop
at another resolution), cached as uint8; and `steadydiff condition` (Canny with double
thresholds, gray, tile), its recipe, and its refusal to overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("cv2")

from steadydiff.cli import main  # noqa: E402
from steadydiff.config import ConfigError, load_config, validate  # noqa: E402
from steadydiff.data import DataError  # noqa: E402
from steadydiff.data.cache import EncodedDataset, encode_conditioning  # noqa: E402
from steadydiff.data.conditioning import make_conditioning  # noqa: E402
from steadydiff.data.pairs import PairError, build_paired  # noqa: E402


def squares(root: Path, n: int = 4, size: tuple[int, int] = (48, 40)) -> Path:
    """``n`` images (w x h = ``size``) of a white square at its own place, captioned."""
    root.mkdir(parents=True, exist_ok=True)
    w, h = size
    for i in range(n):
        a = np.full((h, w, 3), 30, np.uint8)
        a[8:24, 6 + 3 * i:22 + 3 * i] = 250
        Image.fromarray(a).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(f"a square at {i}")
    return root


def data_cfg(path: Path, **data) -> object:
    d = {"dataset": "folder", "path": str(path), "image_size": 32, "channels": 3,
         "captions": "txt", "conditioning": "folder", **data}
    return validate({"data": d, "model": {"pretrained": "unused"},
                     "controlnet": {"enabled": True}}).data


def test_condition_command_writes_canny_maps_and_their_recipe(tmp_path, capsys):
    data = squares(tmp_path / "d")
    assert main(["condition", str(data), "--kind", "canny", "--low", "50", "--high",
                 "150"]) == 0
    out = data / "conditioning"
    edges = np.asarray(Image.open(out / "img0.png"))
    assert edges.shape == (40, 48) and set(np.unique(edges)) <= {0, 255}
    assert edges[7:9, 10].max() == 255 and edges[16, 14] == 0  # the border, not the inside
    recipe = json.loads((out / "conditioning.json").read_text())
    assert recipe["kind"] == "canny" and recipe["params"]["low"] == 50
    assert recipe["params"]["high"] == 150 and len(recipe["files"]) == 4
    # never over an existing file: the command refuses and names them
    before = (out / "img0.png").read_bytes()
    assert main(["condition", str(data), "--kind", "gray"]) == 2
    assert "already exist" in capsys.readouterr().err
    # --force replaces only what it wrote itself
    (out / "mine.png").write_bytes(b"user file")
    assert main(["condition", str(data), "--kind", "gray", "--force"]) == 0
    assert (out / "img0.png").read_bytes() != before
    assert (out / "mine.png").read_bytes() == b"user file"
    assert json.loads((out / "conditioning.json").read_text())["kind"] == "gray"


@pytest.mark.parametrize("args, needle", [
    (["--kind", "canny", "--low", "200", "--high", "100"], "--low < --high"),
    (["--kind", "canny", "--factor", "3"], "does not apply to --kind canny"),
    (["--kind", "tile", "--factor", "1"], "--factor"),
    (["--kind", "canny", "--blur", "4"], "odd"),
])
def test_condition_command_refuses_bad_parameters(tmp_path, capsys, args, needle):
    data = squares(tmp_path / "d", n=1)
    assert main(["condition", str(data), *args]) == 2
    assert needle in capsys.readouterr().err
    assert not (data / "conditioning").exists()


def test_tile_map_is_a_blurred_copy(tmp_path):
    data = squares(tmp_path / "d", n=1)
    rep = make_conditioning(data, tmp_path / "t", "tile", {"factor": 4})
    a = np.asarray(Image.open(tmp_path / "t" / "img0.png")).astype(float)
    src = np.asarray(Image.open(data / "img0.png")).astype(float)
    assert a.shape == src.shape and rep.written == ["img0.png"]
    assert 1 < np.abs(a - src).mean() < 40  # close, but not the image itself


def test_folder_pairs_are_read_and_prepared_like_their_images(tmp_path):
    data = squares(tmp_path / "d")
    make_conditioning(data, None, "canny", {"low": 50, "high": 150})
    ds = build_paired(data_cfg(data))
    assert len(ds) == 4  # the conditioning/ folder holds no training images
    assert ds.conditioning_path_of(1) == data / "conditioning" / "img1.png"
    c = ds.conditioning(1)
    assert c.shape == (3, 32, 32) and 0 <= c.min() and c.max() <= 1
    assert ds.recipe["kind"] == "canny"  # what made them, recorded by the run
    # the same center crop as the image: the conditioning of the image itself is aligned
    img = ds[1][0]  # (3, 32, 32) in [-1, 1]
    bright = img.mean(0) > 0.5
    edge = c.mean(0) > 0.2
    ys, xs = np.nonzero(edge.numpy())
    assert bright[ys.min():ys.max() + 1, xs.min():xs.max() + 1].float().mean() > 0.5


def test_jsonl_pairs_follow_the_diffusers_layout(tmp_path):
    root = tmp_path / "fill"
    (root / "images").mkdir(parents=True)
    (root / "conditioning_images").mkdir()
    rows = []
    for i in range(3):
        a = np.full((32, 32, 3), 40 * i, np.uint8)
        Image.fromarray(a).save(root / "images" / f"{i}.png")
        Image.fromarray(255 - a).save(root / "conditioning_images" / f"{i}.png")
        rows.append({"file_name": f"images/{i}.png", "text": f"shade {i}",
                     "conditioning_image": f"conditioning_images/{i}.png"})
    (root / "metadata.jsonl").write_text("\n".join(map(json.dumps, rows)))
    ds = build_paired(data_cfg(root, captions="jsonl", conditioning="auto"))
    assert len(ds) == 3 and ds.captions == ["shade 0", "shade 1", "shade 2"]
    assert torch.allclose(ds.conditioning(2), torch.full((3, 32, 32), (255 - 80) / 255))


def _errors(tmp_path, setup, **cfg) -> str:
    data = squares(tmp_path / "d")
    make_conditioning(data, None, "gray")
    setup(data)
    with pytest.raises(PairError) as e:
        build_paired(data_cfg(data, **cfg))
    return str(e.value)


def test_bad_pairs_are_one_error_naming_both_files(tmp_path):
    def setup(data: Path) -> None:
        c = data / "conditioning"
        (c / "img0.png").unlink()  # missing partner
        (c / "img1.png").unlink()  # two candidates for img1 (no exact name: by stem)
        Image.new("RGB", (48, 40)).save(c / "img1.jpg")
        Image.new("RGB", (48, 40)).save(c / "img1.webp")
        (c / "img2.png").write_bytes(b"not a png")  # unreadable
        Image.new("L", (24, 20)).save(c / "img3.png")  # half size, same aspect

    msg = _errors(tmp_path, setup)
    d = tmp_path / "d"
    assert f"{d / 'img0.png'}: no {d / 'conditioning' / 'img0'}.*" in msg
    assert f"{d / 'conditioning' / 'img1.jpg'}, {d / 'conditioning' / 'img1.webp'}" in msg
    assert f"{d / 'img2.png'}: its conditioning image {d / 'conditioning' / 'img2.png'} is " \
           "unreadable" in msg
    assert f"{d / 'img3.png'} and {d / 'conditioning' / 'img3.png'}: the image is 48x40, " \
           "the conditioning image 24x20" in msg and "`aspect` accepts" in msg


def test_aspect_match_resizes_and_refuses_another_aspect(tmp_path):
    data = squares(tmp_path / "d", n=2)
    c = data / "conditioning"
    c.mkdir()
    Image.new("RGB", (96, 80), (255, 255, 255)).save(c / "img0.png")  # 2x: accepted
    Image.new("RGB", (48, 48)).save(c / "img1.png")  # square: another aspect
    with pytest.raises(PairError, match=r"aspect ratios differ: the image is 48x40 \(1.200\), "
                                        r"the conditioning image 48x48 \(1.000\)"):
        build_paired(data_cfg(data, conditioning_match="aspect"))
    Image.new("RGB", (24, 20), (255, 255, 255)).save(c / "img1.png")
    ds = build_paired(data_cfg(data, conditioning_match="aspect"))
    assert ds.conditioning(0).shape == (3, 32, 32) and ds.conditioning(0).min() == 1.0


def test_jsonl_errors_name_the_line(tmp_path):
    data = squares(tmp_path / "d", n=1)
    (data / "metadata.jsonl").write_text(json.dumps(
        {"file_name": "img0.png", "conditioning_image": 3}) + "\n")
    with pytest.raises(DataError, match=r"metadata.jsonl:1: \"conditioning_image\" is 3"):
        build_paired(data_cfg(data, conditioning="jsonl"))
    (data / "metadata.jsonl").write_text(json.dumps(
        {"file_name": "img0.png", "conditioning_image": "edges/img0.png"}) + "\n")
    with pytest.raises(PairError, match=r"edges/img0.png \(.*metadata.jsonl:1\) does not exist"):
        build_paired(data_cfg(data, conditioning="jsonl"))


def test_missing_conditioning_folder_says_how_to_make_it(tmp_path):
    data = squares(tmp_path / "d", n=1)
    with pytest.raises(PairError, match="steadydiff condition"):
        build_paired(data_cfg(data))


def test_bucketed_pairs_share_the_crop(tmp_path):
    """With buckets, a conditioning image at twice the resolution is cut to the same region
    of its image and resized to the bucket: a pixel-exact copy gives the image's pixels."""
    data = tmp_path / "d"
    data.mkdir()
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, (80, 128, 3), dtype=np.uint8)  # a 1.6:1 landscape
    Image.fromarray(big).resize((64, 40), Image.Resampling.BOX).save(data / "a.png")
    (data / "a.txt").write_text("noise")
    (data / "conditioning").mkdir()
    Image.fromarray(big).save(data / "conditioning" / "a.png")
    ds = build_paired(data_cfg(data, buckets=True, bucket_step=8, conditioning_match="aspect"))
    x = (ds[0][0] + 1) * 127.5  # the image as prepared
    c = ds.conditioning(0) * 255
    assert x.shape == c.shape and x.shape[1] != x.shape[2]  # a non-square bucket
    assert (x - c).abs().mean() < 12  # the same region (resampled from two resolutions)


def test_conditioning_is_cached_as_uint8_and_rides_at_the_end_of_y(tmp_path):
    from steadydiff.data.cache import LatentResult, TextResult

    data = squares(tmp_path / "d", n=3)
    make_conditioning(data, None, "canny", {"low": 50, "high": 150})
    ds = build_paired(data_cfg(data))
    cache = tmp_path / "cache"
    res = encode_conditioning(ds, prep="p", cache_dir=cache)
    assert res.misses == 3 and res.hits == 0
    files = sorted((cache / "conditioning").rglob("*.safetensors"))
    from safetensors.torch import load_file
    assert len(files) == 3 and load_file(files[0])["conditioning"].dtype == torch.uint8
    again = encode_conditioning(ds, prep="p", cache_dir=cache)
    assert again.hits == 3 and again.misses == 0
    lat = LatentResult(torch.zeros(3, 4, 4, 4), [0, 1, 2], 3)
    texts = TextResult(torch.ones(1, 5, 8), ["x"], torch.zeros(3, dtype=torch.long),
                       torch.zeros(5, 8))
    enc = EncodedDataset(ds, lat, texts, conditioning=again)
    x, y = enc[1]
    rows = -(-3 * 32 * 32 // 8)
    assert y.shape == (5 + rows, 8)
    assert torch.equal(y[5:].reshape(-1)[:3 * 32 * 32].view(3, 32, 32), ds.conditioning(1))
    # the pair is named by both files (what the guard's incidents record)
    assert enc.path_of(1) == f"{data / 'img1.png'} (conditioning " \
                             f"{data / 'conditioning' / 'img1.png'})"
    # a deleted cache entry: read from the file again, the same values
    files[0].unlink()
    assert torch.equal(again.get(0), ds.conditioning(0))


def test_an_undecodable_conditioning_image_quarantines_its_pair(tmp_path):
    from steadydiff.data.cache import LatentResult, TextResult

    data = squares(tmp_path / "d", n=3)
    make_conditioning(data, None, "gray")
    ds = build_paired(data_cfg(data))
    # header fine, pixels truncated: found when decoded (before training, at encoding)
    f = data / "conditioning" / "img2.png"
    f.write_bytes(f.read_bytes()[:-40])
    res = encode_conditioning(ds, prep="p", cache_dir=tmp_path / "cache")
    assert list(res.quarantined) == [2] and "img2.png" in res.quarantined[2]["why"]
    lat = LatentResult(torch.zeros(3, 4, 4, 4), [0, 1, 2], 3)
    texts = TextResult(torch.ones(1, 5, 8), ["x"], torch.zeros(3, dtype=torch.long),
                       torch.zeros(5, 8))
    enc = EncodedDataset(ds, lat, texts, conditioning=res)
    assert len(enc) == 2 and 2 in enc.quarantined


def test_config_ties_conditioning_to_controlnet(tmp_path):
    with pytest.raises(ConfigError, match="controlnet.enabled=true"):
        load_config("configs/sd_lora.yaml", ["data.conditioning=folder",
                                              "model.pretrained=x", "data.path=y"])
    with pytest.raises(ConfigError, match="adapter.kind=none"):
        load_config("configs/sd_lora.yaml", ["controlnet.enabled=true", "model.pretrained=x",
                                              "data.path=y", "data.conditioning=folder"])
    with pytest.raises(ConfigError, match="controlnet.start"):
        load_config("configs/sd_lora.yaml", ["controlnet.start=0.6", "controlnet.end=0.5"])
