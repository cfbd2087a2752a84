"""The latent and text-embedding cache: keys, invalidation, distrust of the disk, NaN latents.

A tiny real diffusers VAE (random weights, 16 px images -> 4×8×8 latents) over PNGs written
in tmp_path; the text encoder is a small deterministic function of the caption's bytes.
NaN latents are injected by wrapping ``encode``, the way an fp16 VAE produces them.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

from steadydiff.data import DataError, ImageFolderDataset, source_of
from steadydiff.data.cache import (
    EncodedDataset,
    encode_latents,
    encode_texts,
    file_digest,
    module_identity,
)

N = 6
PREP = "size=16,crop=center,channels=3"
SCALE = 0.18215


@pytest.fixture(scope="module")
def vae():
    pytest.importorskip("diffusers", reason="the sd extra (diffusers)")
    from steadydiff.integrations.sd.tiny import tiny_vae

    return tiny_vae(widths=(16, 32), sample_size=16, seed=0)


def _encoder(vae):
    """The caller's encode: the latent distribution's mean (deterministic), scaled."""
    calls = []

    def encode(x):
        calls.append(x.shape[0])
        return vae.encode(x).latent_dist.mean * SCALE

    encode.calls = calls
    return encode


def _write(folder: Path, i: int, color: tuple[int, int, int]) -> Path:
    p = folder / f"img{i:02d}.png"
    im = Image.new("RGB", (16, 16), color)
    im.putpixel((i, 3), (255 - color[0], 0, 255))  # no two images alike
    im.save(p)
    return p


@pytest.fixture()
def folder(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    for i in range(N):
        _write(root, i, (40 * i, 100, 200 - 30 * i))
    return root


def _data(root):
    return ImageFolderDataset(root, image_size=16, channels=3)


def _files(cache: Path, kind: str = "latents") -> list[Path]:
    return sorted((cache / kind).glob("*/*.safetensors"))


def _run(vae, root, cache, *, encoder_id="vae-a", prep=PREP, **kw):
    enc = kw.pop("encode", None) or _encoder(vae)
    return encode_latents(_data(root), enc, encoder_id=encoder_id, prep=prep, cache_dir=cache,
                          **kw), enc


# --------------------------------------------------------------------------- identities


def test_file_digest_is_the_sha256_of_the_bytes(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(3 * (1 << 20) + 17))  # more than one 1 MB chunk
    assert file_digest(p) == hashlib.sha256(p.read_bytes()).hexdigest()
    with pytest.raises(DataError, match="missing.bin"):
        file_digest(tmp_path / "missing.bin")


def test_module_identity_follows_weights_config_and_extra(vae):
    a = module_identity(vae)
    assert len(a) == 64 and a == module_identity(copy.deepcopy(vae))
    other = copy.deepcopy(vae)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1e-3  # one element
    assert module_identity(other) != a
    assert module_identity(vae, extra={"scale": SCALE}) != a
    # same weights stored in fp16: other bytes, other id
    assert module_identity(copy.deepcopy(vae).half()) != a
    # the config counts even when the weights agree: a layer without weights, another setting
    plain = torch.nn.Sequential(torch.nn.SiLU())
    alt = torch.nn.Sequential(torch.nn.SiLU())
    alt.config = {"act": "gelu", "_name_or_path": "/somewhere"}
    assert module_identity(plain) != module_identity(alt)
    # but where it was loaded from ("_" keys) does not
    alt2 = torch.nn.Sequential(torch.nn.SiLU())
    alt2.config = {"act": "gelu", "_name_or_path": "/elsewhere"}
    assert module_identity(alt) == module_identity(alt2)


def test_module_identity_hashes_bf16_bytes_as_stored():
    m = torch.nn.Linear(3, 2).to(torch.bfloat16)
    a = module_identity(m)
    with torch.no_grad():
        m.weight.view(torch.int16).view(-1)[0] ^= 1  # flip the lowest bit of one bf16 element
    assert module_identity(m) != a


# --------------------------------------------------------------------------- latent keys


def test_a_hit_equals_the_recompute_bit_exactly(vae, folder, tmp_path):
    cache = tmp_path / "cache"
    first, enc1 = _run(vae, folder, cache)
    assert (first.hits, first.misses) == (0, N) and sum(enc1.calls) == N
    assert first.latents.shape == (N, 4, 8, 8) and first.latents.dtype == torch.float32
    assert first.index == list(range(N)) and not first.quarantined and not first.reencoded
    files = _files(cache)
    assert len(files) == N and all(f.parent.name == f.stem[:2] for f in files)

    again, enc2 = _run(vae, folder, cache)
    assert (again.hits, again.misses) == (N, 0) and enc2.calls == []
    memory, _ = _run(vae, folder, None)  # no cache: recomputed
    assert (memory.hits, memory.misses) == (0, N)
    assert torch.equal(again.latents, first.latents)
    assert torch.equal(memory.latents, first.latents)
    assert not (tmp_path / "latents").exists()  # cache_dir=None wrote nothing


def test_a_changed_image_invalidates_only_its_entry(vae, folder, tmp_path):
    cache = tmp_path / "cache"
    first, _ = _run(vae, folder, cache)
    _write(folder, 2, (255, 0, 0))
    second, enc = _run(vae, folder, cache)
    assert (second.hits, second.misses) == (N - 1, 1) and enc.calls == [1]
    changed = [i for i in range(N) if not torch.equal(first.latents[i], second.latents[i])]
    assert changed == [2]
    assert len(_files(cache)) == N + 1  # the old entry is a dead file, never read


def test_changed_weights_or_prep_invalidate_every_entry(vae, folder, tmp_path):
    cache = tmp_path / "cache"
    _run(vae, folder, cache, encoder_id=module_identity(vae))
    other = copy.deepcopy(vae)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1e-3
    new_id = module_identity(other)
    changed, _ = _run(other, folder, cache, encoder_id=new_id)
    assert (changed.hits, changed.misses) == (0, N)
    reprep, _ = _run(other, folder, cache, encoder_id=new_id, prep=PREP.replace("16", "17"))
    assert (reprep.hits, reprep.misses) == (0, N)
    same, _ = _run(other, folder, cache, encoder_id=new_id)
    assert (same.hits, same.misses) == (N, 0)


def test_an_untrustworthy_cache_file_is_a_miss_and_is_rewritten(vae, folder, tmp_path):
    cache = tmp_path / "cache"
    first, _ = _run(vae, folder, cache)
    files = _files(cache)
    data = files[0].read_bytes()
    files[0].write_bytes(data[:len(data) // 2])  # truncated (a killed writer of old)
    files[1].write_bytes(b"not a safetensors file")
    key2 = files[2].stem
    save_file({"latent": torch.zeros(2, 2, 2)}, files[2], metadata={"key": key2})  # shape
    save_file({"latent": torch.full((4, 8, 8), float("nan"))}, files[3],
              metadata={"key": files[3].stem})  # non-finite
    save_file({"latent": first.latents[0].double()}, files[4],
              metadata={"key": files[4].stem})  # dtype
    os.replace(files[0], files[0].with_name("x.tmp"))
    # the entry of item 5 copied under another key: a valid file, but not that key's
    save_file(load_file(files[5]), files[0], metadata={"key": files[5].stem})

    second, _ = _run(vae, folder, cache)
    assert (second.hits, second.misses) == (1, N - 1)
    # re-encoded in other batches than the first time: equal to float rounding (a conv's
    # kernel choice depends on the batch size), not bit for bit
    assert torch.allclose(second.latents, first.latents, atol=1e-6)
    third, enc = _run(vae, folder, cache)
    assert (third.hits, third.misses) == (N, 0) and enc.calls == []


def test_a_failed_write_leaves_neither_a_file_nor_a_temp(vae, folder, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def killed(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError, match="killed"):
        _run(vae, folder, cache)
    monkeypatch.undo()
    assert [p for p in (cache / "latents").rglob("*") if p.is_file()] == []


def test_a_dataset_without_files_is_keyed_by_the_image_bytes(vae, tmp_path):
    class Tensors(Dataset):
        def __init__(self, x):
            self.x = x

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], torch.tensor(0)

    x = torch.rand(4, 3, 16, 16) * 2 - 1
    enc = _encoder(vae)
    a = encode_latents(Tensors(x), enc, encoder_id="v", prep="p", cache_dir=tmp_path)
    assert source_of(Tensors(x), 0) is None and a.misses == 4
    x2 = x.clone()
    x2[1, 0, 0, 0] += 0.5
    b = encode_latents(Tensors(x2), enc, encoder_id="v", prep="p", cache_dir=tmp_path)
    assert (b.hits, b.misses) == (3, 1)


# --------------------------------------------------------------------------- NaN latents


def _fp16_like(vae, bad: int):
    """An encode whose latent of item ``bad`` (found by its pixel) overflows, as an fp16
    VAE's does on some images."""
    base = _encoder(vae)

    def encode(x):
        z = base(x).clone()
        for b in range(x.shape[0]):
            if _marked(x[b], bad):
                z[b, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])
        return z

    encode.calls = base.calls
    return encode


def _marked(img, i):
    """Item i's own pixel (see _write): column i, row 3 has green 0 and blue 255."""
    return bool(img[1, 3, i] < -0.99) and bool(img[2, 3, i] > 0.99)


def test_a_nan_latent_is_reencoded_by_the_fallback_and_kept(vae, folder, tmp_path):
    cache = tmp_path / "cache"
    ref, _ = _run(vae, folder, None)
    res, _ = _run(vae, folder, cache, encode=_fp16_like(vae, 3), fallback=_encoder(vae))
    assert res.index == list(range(N)) and not res.quarantined
    assert [r["index"] for r in res.reencoded] == [3]
    assert res.reencoded[0]["source"] == str(folder / "img03.png")
    assert torch.isfinite(res.latents).all()
    assert torch.allclose(res.latents, ref.latents, atol=1e-6)
    again, _ = _run(vae, folder, cache, encode=_fp16_like(vae, 3), fallback=_encoder(vae))
    assert again.hits == N and again.reencoded == []  # the fallback's latent was cached


def test_nan_in_both_encoders_quarantines_the_sample(vae, folder, tmp_path):
    cache = tmp_path / "cache"
    res, _ = _run(vae, folder, cache, encode=_fp16_like(vae, 4), fallback=_fp16_like(vae, 4))
    assert res.index == [0, 1, 2, 3, 5] and res.latents.shape == (N - 1, 4, 8, 8)
    assert torch.isfinite(res.latents).all() and res.reencoded == []
    q = res.quarantined[4]
    assert q["index"] == 4 and q["source"] == str(folder / "img04.png")
    assert "again from the fallback" in q["why"] and "2 NaN, 1 Inf of 256 elements" in q["why"]
    assert len(_files(cache)) == N - 1  # nothing written for it
    ds = EncodedDataset(_data(folder), res)
    assert len(ds) == N - 1 and ds.quarantined == res.quarantined
    assert str(folder / "img04.png") not in [ds.path_of(i) for i in range(len(ds))]
    assert ds.path_of(4) == str(folder / "img05.png") and ds.source_index(4) == 5
    # the next run tries again (a quarantine is not cached) and quarantines again
    again, _ = _run(vae, folder, cache, encode=_fp16_like(vae, 4))
    assert again.hits == N - 1 and "no fallback" in again.quarantined[4]["why"]


def test_an_image_unreadable_at_load_time_is_quarantined_not_cached_as_its_stand_in(
        vae, folder, tmp_path):
    cache = tmp_path / "cache"
    src = _data(folder)  # the header check passes now; the file breaks afterwards
    bad = folder / "img01.png"
    bad.write_bytes(bad.read_bytes()[:60])  # truncated: fails to decode
    res = encode_latents(src, _encoder(vae), encoder_id="v", prep=PREP, cache_dir=cache)
    assert res.index == [0, 2, 3, 4, 5] and len(_files(cache)) == N - 1
    assert res.quarantined[1]["source"] == str(bad)
    assert "unreadable" in res.quarantined[1]["why"]


# --------------------------------------------------------------------------- text


L, D = 5, 3


def _text_encoder():
    calls: list[str] = []

    def encode_text(texts):
        calls.extend(texts)
        out = torch.zeros(len(texts), L, D)
        for b, t in enumerate(texts):
            codes = torch.tensor(list(t.encode()[:L]) + [0] * (L - len(t.encode()[:L])))
            out[b] = torch.stack([codes / 255, (codes % 7) / 7, torch.full((L,), len(t))], -1)
        return out

    encode_text.calls = calls
    return encode_text


CAPTIONS = ["a shoe", "a bag", "a shoe", "a coat", "a bag", "a shoe"]


def test_text_cache_encodes_each_distinct_caption_once(tmp_path):
    enc = _text_encoder()
    res = encode_texts(CAPTIONS, enc, encoder_id="clip-a", cache_dir=tmp_path)
    assert sorted(enc.calls) == sorted(["a shoe", "a bag", "a coat", ""])
    assert res.captions == ["a shoe", "a bag", "a coat"]
    assert res.caption_index.tolist() == [0, 1, 0, 2, 1, 0]
    assert res.contexts.shape == (3, L, D) and res.contexts.dtype == torch.float32
    for i, c in enumerate(CAPTIONS):
        assert torch.equal(res.contexts[res.caption_index[i]], _text_encoder()([c])[0])
    assert torch.equal(res.null, _text_encoder()([""])[0])
    assert (res.hits, res.misses) == (0, 4) and len(_files(tmp_path, "text")) == 4

    enc2 = _text_encoder()
    again = encode_texts(CAPTIONS + ["a hat"], enc2, encoder_id="clip-a", cache_dir=tmp_path)
    assert enc2.calls == ["a hat"] and (again.hits, again.misses) == (4, 1)
    assert torch.equal(again.contexts[:3], res.contexts) and torch.equal(again.null, res.null)
    other = encode_texts(CAPTIONS, _text_encoder(), encoder_id="clip-b", cache_dir=tmp_path)
    assert other.hits == 0


def test_a_nonfinite_text_embedding_is_reencoded_then_left_out_by_caption():
    """A caption's embedding non-finite: encoded again with the fallback (fp32); finite, it
    is kept; still non-finite (or no fallback), the caption is in ``bad`` (its items are the
    caller's to leave out) with ``blame``'s words. The empty caption must be finite."""
    base = _text_encoder()

    def broken(texts, what=("a coat",)):
        e = base(texts)
        e[[t in what for t in texts]] = float("nan")
        return e

    r = encode_texts(CAPTIONS, broken, encoder_id="x", cache_dir=None,
                     blame=lambda c: "token 'coat'")
    assert list(r.bad) == ["a coat"] and "non-finite" in r.bad["a coat"]
    assert "token 'coat'" in r.bad["a coat"] and torch.isfinite(r.contexts).all()
    r = encode_texts(CAPTIONS, broken, encoder_id="x", cache_dir=None, fallback=base)
    assert r.reencoded == ["a coat"] and not r.bad
    row = r.captions.index("a coat")
    torch.testing.assert_close(r.contexts[row], base(["a coat"])[0].float())
    with pytest.raises(DataError, match="empty caption"):
        encode_texts(CAPTIONS, lambda t: broken(t, ("",)), encoder_id="x", cache_dir=None)


# --------------------------------------------------------------------------- the dataset


def test_encoded_dataset_items_paths_describe_and_pickle(vae, folder):
    src = _data(folder)
    lat = encode_latents(src, _fp16_like(vae, 1), encoder_id="v", prep=PREP, cache_dir=None)
    txt = encode_texts(CAPTIONS, _text_encoder(), encoder_id="t", cache_dir=None)
    ds = EncodedDataset(src, lat, txt)
    assert len(ds) == N - 1 and ds.num_classes == 0
    assert (ds.channels, ds.image_size, ds.context_shape) == (4, 8, (L, D))
    assert torch.equal(ds.null_context, txt.null)
    x, c = ds[1]  # source item 2, "a shoe"
    assert ds.source_index(1) == 2 and ds.path_of(1) == str(folder / "img02.png")
    assert source_of(ds, 1) == ds.path_of(1)  # the guard's way of naming a sample
    assert torch.equal(x, lat.latents[1]) and torch.equal(c, txt.contexts[0])
    assert x.shape == (4, 8, 8) and c.shape == (L, D) and x.dtype == c.dtype == torch.float32
    x.add_(1.0)
    assert torch.equal(ds[1][0], lat.latents[1])  # items are copies
    assert ds.describe() == ("EncodedDataset: 5 latents 4×8×8 of ImageFolderDataset "
                             "(1 quarantined), 3 distinct captions 5×3")

    back = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 40_000  # tensors and strings, no source dataset
    for i in range(len(ds)):
        assert all(torch.equal(a, b) for a, b in zip(back[i], ds[i]))
    assert back.path_of(3) == ds.path_of(3)


def test_encoded_dataset_pixel_space_unconditional(folder):
    src = _data(folder)
    ds = EncodedDataset(src)
    assert len(ds) == N and ds.context_shape is None and ds.null_context is None
    x, c = ds[2]
    assert torch.equal(x, src[2][0]) and c.item() == 0
    assert (ds.channels, ds.image_size) == (3, 16)
    assert ds.describe() == ("EncodedDataset: 6 images 3×16×16 of ImageFolderDataset, "
                             "unconditional")
    with pytest.raises(DataError, match="7 captions"):
        EncodedDataset(src, None, encode_texts(CAPTIONS + ["x"], _text_encoder(),
                                               encoder_id="t", cache_dir=None))


# --------------------------------------------------------------------------- a pure function
# The cache is a pure function of its inputs (issue 28, item 11): each item's latent and each
# caption's embedding independent of what else was encoded with it, so a cache filled in two
# runs (stopped or killed, then resumed) equals one filled in one go, bit for bit; a killed
# writer's temporary is swept at the next start.


def _batch_sensitive(encode):
    """``encode`` whose output moves in the last bits with its batch's other members, as a
    real VAE's does (1.3e-6 between a batch of 1 and one of 8 for SD's): exactly what a
    cache keyed by one image must never let in."""
    def enc(x):
        return encode(x) + 1e-3 * x.mean() * (x.shape[0] > 1)
    enc.calls = getattr(encode, "calls", [])
    return enc


def _tensors(cache: Path, kind: str = "latents") -> dict[str, torch.Tensor]:
    return {p.name: next(iter(load_file(p).values())) for p in _files(cache, kind)}


def test_a_cache_filled_in_two_runs_equals_one_filled_at_once(vae, folder, tmp_path):
    from steadydiff.data.cache import CachingStopped

    whole, enc = _run(vae, folder, tmp_path / "whole", encode=_batch_sensitive(_encoder(vae)))
    assert enc.calls == [1] * N  # every image alone
    asked = []

    def stop():  # a stop signal after the third image
        asked.append(1)
        return len(asked) > 3
    with pytest.raises(CachingStopped, match="3 encoded in this run, 3 left"):
        _run(vae, folder, tmp_path / "twice", encode=_batch_sensitive(_encoder(vae)),
             stop=stop)
    assert len(_files(tmp_path / "twice")) == 3  # complete entries only
    again, _ = _run(vae, folder, tmp_path / "twice", encode=_batch_sensitive(_encoder(vae)))
    assert (again.hits, again.misses) == (3, 3)
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "twice")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(again.latents, whole.latents)


def test_text_embeddings_do_not_depend_on_what_else_was_missing(tmp_path):
    def sensitive(texts):  # a batch's padding and kernels move the last bits
        return _text_encoder()(texts) + 1e-3 * (len(texts) - 1)
    whole = encode_texts(CAPTIONS, sensitive, encoder_id="t", cache_dir=tmp_path / "a")
    encode_texts(CAPTIONS[:2], sensitive, encoder_id="t", cache_dir=tmp_path / "b")
    part = encode_texts(CAPTIONS, sensitive, encoder_id="t", cache_dir=tmp_path / "b")
    assert part.hits == 3 and torch.equal(part.contexts, whole.contexts)
    assert torch.equal(part.null, whole.null)


def test_stray_temporaries_of_dead_writers_are_swept(vae, folder, tmp_path):
    import subprocess
    import sys
    import time

    from steadydiff.data import cache as cache_mod

    cache = tmp_path / "cache"
    _run(vae, folder, cache)
    sub = _files(cache)[0].parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    host = cache_mod._HOST
    left = sub / f".{'a' * 64}.safetensors.{host}-{dead}-0123abcd.tmp"  # a killed writer's
    live = sub / f".{'b' * 64}.safetensors.{host}-{os.getpid()}-0123abcd.tmp"  # writing now
    remote = sub / f".{'c' * 64}.safetensors.otherhost-{dead}-0123abcd.tmp"  # another host's
    old = sub / f".{'d' * 64}.safetensors.{dead}-0123abcd.tmp"  # an earlier version's, a day old
    for p in (left, live, remote, old):
        p.write_bytes(b"half a file")
    os.utime(old, (time.time() - 2 * cache_mod.STALE_TMP_S,) * 2)
    res, _ = _run(vae, folder, cache)
    assert res.hits == N
    assert not left.exists() and not old.exists()
    assert live.exists() and remote.exists()  # maybe still being written: never touched


_KILLED_WRITER = r'''
import os, signal, sys
from pathlib import Path
import torch
from steadydiff.data import ImageFolderDataset
from steadydiff.data import cache
from steadydiff.integrations.sd.tiny import tiny_vae

vae = tiny_vae(widths=(16, 32), sample_size=16, seed=0)
saves = []
real_fsync = os.fsync

def fsync(fd):  # the 4th entry's bytes are in its temporary file: the power goes out
    saves.append(fd)
    if len(saves) == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)

os.fsync = fsync
cache.encode_latents(ImageFolderDataset(sys.argv[1], image_size=16, channels=3),
                     lambda x: vae.encode(x).latent_dist.mean * 0.18215,
                     encoder_id=cache.module_identity(vae), prep="p", cache_dir=sys.argv[2])
'''


def test_a_kill_mid_write_then_rerun_equals_an_uninterrupted_cache(vae, folder, tmp_path):
    import signal
    import subprocess
    import sys

    killed = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(folder), str(killed)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    stray = list(killed.rglob(".*.tmp"))
    assert len(stray) == 1 and len(_files(killed)) == 3  # three entries and half of one

    def run(cache):
        return encode_latents(_data(folder), _encoder(vae), encoder_id=module_identity(vae),
                              prep="p", cache_dir=cache)
    resumed = run(killed)
    assert (resumed.hits, resumed.misses) == (3, N - 3)
    assert not list(killed.rglob(".*.tmp"))  # swept: its writer is dead
    whole = run(tmp_path / "whole")
    a, b = _tensors(tmp_path / "whole"), _tensors(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(resumed.latents, whole.latents)
