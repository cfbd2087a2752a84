"""What SD fine-tuners do every day (issue 31, part B): hub ids answered with the download
command, separate learning rates per part, diffusers LoRA files older diffusers load at the
right strength, LoRA variants, textual inversion, a quiet log."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("diffusers")

from steadydiff.cli import main  # noqa: E402

HUB_ID = "stable-diffusion-v1-5/stable-diffusion-v1-5"


# --------------------------------------------------------------------------- hub ids


def test_a_hub_id_is_answered_with_the_download_command_and_nothing_is_fetched(
        tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def no_download(*a, **k):
        raise AssertionError("a download was attempted")

    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, no_download)
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    data = tmp_path / "images"
    data.mkdir()
    rc = main(["train", str(Path(__file__).parents[1] / "configs" / "sd_lora.yaml"),
               "--set", f"model.pretrained={HUB_ID}", "--set", f"data.path={data}",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "hub id" in err and "never downloads" in err
    major = int(huggingface_hub.__version__.split(".")[0])
    cli = "hf" if major >= 1 else "huggingface-cli"
    assert f"{cli} download {HUB_ID} --local-dir models/stable-diffusion-v1-5" in err
    assert "model.single_file_config" in err and ".safetensors" in err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("path, hub", [
    (HUB_ID, True), ("runwayml/stable-diffusion-v1-5", True),
    ("models/sd15/unet", False), ("/abs/path", False), ("./sd15", False),
    ("my-model", False), ("~/models", False), ("dir/model.safetensors", False),
])
def test_what_reads_as_a_hub_id(path, hub):
    from steadydiff.integrations.sd.folder import is_hub_id

    assert is_hub_id(path) is hub
