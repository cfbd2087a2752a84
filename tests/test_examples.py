"""The examples/ loops run as written, survive the faults they inject, and the README's and
docs/guard.md's snippets are excerpts of them (so the docs show code that runs)."""

import ast
import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# the doc sections that show the guard in a loop of one's own: every python block there is
# an excerpt of the example its first line names
SECTIONS = [("README.md", "### 3. Put the guard in your own training loop"),
            ("docs/guard.md", "## Using `Guard` in your own loop"),
            ("docs/guard.md", "## An ordinary DataLoader loop"),
            ("docs/guard.md", "## Inside a diffusers LoRA script")]


def run_example(name, tmp_path, *args):
    r = subprocess.run([sys.executable, str(EXAMPLES / name), "--out", str(tmp_path / "run"),
                        *args], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    p = tmp_path / "run" / "incidents.jsonl"
    return r.stdout, [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def learned(out):
    first, last = map(float, re.search(r"loss ([\d.]+) \(first \d+\) -> ([\d.]+) \(last", out)
                      .groups())
    return last < 0.8 * first


def test_guard_loop_healthy(tmp_path):
    out, rows = run_example("guard_loop.py", tmp_path, "--steps", "30", "--log-every", "10")
    assert "guard: healthy run, no incidents" in out and rows == []
    assert "finished 30 steps" in out and learned(out)


def test_guard_loop_survives_a_nan_batch(tmp_path):
    out, rows = run_example("guard_loop.py", tmp_path, "--steps", "30", "--inject-nan", "12")
    assert "guard: skip at step 12 (bad_batch)" in out
    assert "guard: 1 incident; 1 skipped step(s), 0 rollback(s)" in out
    assert "finished 30 steps" in out and learned(out)
    assert [(r["step"], r["kind"], r["action"]) for r in rows] == [(12, "bad_batch", "skip")]


def test_accelerate_style_fp16_survives_an_overflow_and_a_nan_batch(tmp_path):
    out, rows = run_example("guard_accelerate_style.py", tmp_path, "--steps", "20",
                            "--inject-overflow", "8", "--inject-nan", "12")
    # the overflow is the GradScaler's: a skip, a halved scale, no incident
    assert "guard: skip at step 8 (fp16 overflow: the scaler skips)" in out
    assert "guard: skip at step 12 (bad_batch)" in out
    assert "guard: 1 incident;" in out and "1 fp16 overflow skip(s)" in out
    assert "finished 20 steps" in out and "loss scale" in out
    assert [(r["step"], r["kind"], r["action"]) for r in rows] == [(12, "bad_batch", "skip")]


@pytest.mark.parametrize("accelerate", [False, True], ids=["plain", "accelerate"])
def test_dataloader_loop_follows_a_rollback(tmp_path, accelerate):
    """A plain ``for batch in loader`` loop with its own step counter (and the same with the
    real accelerate package): a weight corrupted by the loop's own code before step 45 is
    rolled back to the step-40 snapshot; the decision says how far back, the loop's counter
    follows, the loader goes on, and the run finishes its steps having learned. The incident
    is an ``error`` (recovered), not ``fatal``."""
    if accelerate:
        pytest.importorskip("accelerate")
    out, rows = run_example("guard_dataloader.py", tmp_path, "--steps", "60",
                            "--corrupt-weight", "45", *(["--accelerate"] if accelerate else []))
    assert "guard: rollback at step 45 (weight_jump): 5 step(s) back to step 40" in out
    assert "finished 60 steps" in out and learned(out)
    assert [(r["step"], r["kind"], r["action"], r["severity"]) for r in rows] == [
        (45, "weight_jump", "rollback", "error")]


def snippets():
    """(doc, example file, the snippet's lines) for every python block of SECTIONS."""
    found = []
    for doc, heading in SECTIONS:
        text = (ROOT / doc).read_text()
        section = text[text.index(heading):]
        section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
        for block in re.findall(r"```python\n(.*?)```", section, re.S):
            head, *lines = block.splitlines()
            m = re.match(r"# (examples/\S+\.py)", head)
            assert m, f"{doc}: a snippet must name the example it is an excerpt of: {head!r}"
            found.append((doc, m.group(1), lines))
    return found


def test_the_docs_show_snippets():
    assert {doc for doc, _, _ in snippets()} == {doc for doc, _ in SECTIONS}
    assert {ex for _, ex, _ in snippets()} == {"examples/guard_loop.py",
                                               "examples/guard_accelerate_style.py",
                                               "examples/guard_dataloader.py",
                                               "examples/guard_sd_lora.py"}


@pytest.mark.parametrize("doc,example,lines", snippets(),
                         ids=[f"{d}:{e}" for d, e, _ in snippets()])
def test_doc_snippet_is_an_excerpt_of_the_example(doc, example, lines):
    """Every line of the snippet is a line of the example, in the same order (indentation
    aside: the example's loop sits in main()), and the snippet itself is valid Python."""
    ast.parse(textwrap.dedent("\n".join(lines)))
    source = [l.strip() for l in (ROOT / example).read_text().splitlines()]
    i = 0
    for line in (l.strip() for l in lines if l.strip()):
        try:
            i = source.index(line, i) + 1
        except ValueError:
            pytest.fail(f"{doc}: not in {example} (after line {i}), or out of order: {line!r}")


# ---- examples/guard_sd_lora.py: the guard inside a diffusers-style LoRA script

@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    """A tiny Stable Diffusion folder (random weights, built from configs: no download)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny", prediction="v_prediction")


def saved_lora(run):
    from safetensors.torch import load_file

    return load_file(run / "pytorch_lora_weights.safetensors")


def test_sd_lora_healthy_writes_a_lora_that_diffusers_loads(tmp_path, tiny_sd):
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    out, rows = run_example("guard_sd_lora.py", tmp_path, "--model", str(tiny_sd),
                            "--steps", "12", "--rank", "4", "--alpha", "8")
    assert "v_prediction prediction" in out  # the target follows the scheduler's config
    assert "guard: healthy run, no incidents" in out and rows == []
    first, last = map(float, re.search(r"loss ([\d.]+) \(first \d+\) -> ([\d.]+)", out).groups())
    assert "finished 12 steps" in out and math.isfinite(first) and math.isfinite(last)
    run = tmp_path / "run"
    saved = saved_lora(run)
    assert saved and all(torch.isfinite(v).all() for v in saved.values())
    # diffusers loads it back into a pipeline of the same folder, weights and scale intact
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd, local_files_only=True,
                                                   safety_checker=None)
    pipe.load_lora_weights(run)
    (adapter,) = pipe.unet.active_adapters()
    cfg = pipe.unet.peft_config[adapter]
    assert (cfg.r, cfg.lora_alpha) == (4, 8)  # the metadata: the trained scale, not r's
    loaded = convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet,
                                                                       adapter_name=adapter))
    assert {f"unet.{k}" for k in loaded} == set(saved)
    for k, v in loaded.items():
        assert torch.equal(v, saved[f"unet.{k}"]), k
    # and the LoRA is not its initialisation: training moved the up projections off zero
    assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora.up." in k)


def test_sd_lora_survives_a_nan_latents_batch(tmp_path):
    import torch

    pytest.importorskip("diffusers")
    out, rows = run_example("guard_sd_lora.py", tmp_path, "--steps", "12", "--inject-nan", "7")
    assert "no --model given: built a tiny Stable Diffusion" in out
    assert (tmp_path / "run" / "tiny_sd" / "model_index.json").exists()
    assert "guard: skip at step 7 (bad_batch)" in out
    assert "guard: 1 incident; 1 skipped step(s), 0 rollback(s)" in out
    assert [(r["step"], r["kind"], r["action"]) for r in rows] == [(7, "bad_batch", "skip")]
    # the sample attribution names the corrupt sample: the first of the batch of step 7
    (sample,) = rows[0]["evidence"]["samples"]
    assert (sample["position"], sample["index"], sample["why"]) == (0, 56 % 12, "non-finite input")
    assert "finished 12 steps" in out and "nan" not in out.split("finished")[1]
    assert "LoRA (verified finite by the guard) written to" in out
    assert all(torch.isfinite(v).all() for v in saved_lora(tmp_path / "run").values())
