"""Smoke tests of the bench/ scripts: each runs in a subprocess with tiny settings and
``--json``, and its last line must be one JSON object with the documented keys (the figures,
the machine, the versions). They check the plumbing and the arithmetic that turns the
measurements into figures (ratios, rates, ranges), not how fast this machine is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import math
import statistics

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def _run(script: str, *args: str, timeout: int = 300, check: bool = True):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def _last_json(stdout: str) -> dict:
    last = stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert isinstance(out, dict)
    for key in ("machine", "versions"):
        assert key in out
    assert {"cpu", "cores"} <= set(out["machine"])
    assert {"python", "torch", "steadydiff"} <= set(out["versions"])
    return out


@pytest.mark.parametrize("script", ["throughput.py", "samplers.py", "stability.py",
                                    "logging_overhead.py", "eval_samplers.py",
                                    "eval_sanity.py", "eval_curves.py", "posthoc_ema.py",
                                    "grow_resolution.py", "sd_overhead.py", "sd_faults.py",
                                    "fashion_text.py", "gpu.py", "fsdp_memory.py",
                                    "objectives.py", "flow_overhead.py", "flow_learns.py"])
def test_help(script):
    p = _run(script, "--help", timeout=60)
    assert "--json" in p.stdout


def test_throughput_smoke():
    p = _run("throughput.py", "--steps", "1", "--repeats", "1", "--warmup", "0",
             "--sample-steps-scale", "0.01", "--sample-num", "4", "--sample-repeats", "1",
             "--json")
    out = _last_json(p.stdout)
    tr = out["training"]
    sec = tr["sec_per_step"]
    assert set(sec) == {"bare", "off", "guard"}
    # one repeat of one step each: every median is that one timing, a real duration
    for k, v in sec.items():
        assert tr["repeats_sec_per_step"][k] == [v] and 0 < v < 60, (k, v)
    assert tr["steps_per_repeat"] == 1 and tr["repeats"] == 1
    # the figures are the stated ratios of those timings, not independent numbers
    assert tr["ratio_guard_vs_bare"] == pytest.approx(sec["guard"] / sec["bare"], rel=1e-9)
    assert tr["ratio_off_vs_bare"] == pytest.approx(sec["off"] / sec["bare"], rel=1e-9)
    assert tr["guard_overhead"] == pytest.approx(sec["guard"] / sec["off"] - 1, rel=1e-9)
    assert tr["guard_overhead"] > -1 and tr["ratio_guard_vs_bare"] > 0
    # this process's CPU time per step, measured with the wall time of the same repeats
    cpu = tr["cpu_sec_per_step"]
    for k, v in cpu.items():
        assert tr["repeats_cpu_sec_per_step"][k] == [v] and 0 < v < 60, (k, v)
    assert tr["ratio_guard_vs_bare_cpu"] == pytest.approx(cpu["guard"] / cpu["bare"], rel=1e-9)
    assert tr["ratio_off_vs_bare_cpu"] == pytest.approx(cpu["off"] / cpu["bare"], rel=1e-9)
    assert 0 < tr["data_loading_sec_per_batch"] < 10  # seconds per batch of 8x8 digits
    # --sample-steps-scale 0.01 of 1000 (ddpm) and 50 or 20 (the others) rounds to 10, 1
    assert {k: v["steps"] for k, v in out["sampling"].items()} == \
        {"ddpm": 10, "ddim": 1, "dpmpp_2m": 1, "euler": 1}
    for v in out["sampling"].values():
        assert v["num"] == 4 and 0 < v["seconds"] < 60
        assert v["images_per_sec"] == pytest.approx(v["num"] / v["seconds"], rel=1e-9)
        assert v["sec_per_model_eval"] == pytest.approx(v["seconds"] / v["steps"], rel=1e-9)
    assert "trainer (guard on) vs bare loop" in p.stdout  # the human-readable table


@pytest.mark.slow  # inductor builds the quick-start UNet's C++ kernels: minutes cold
def test_throughput_compile_smoke():
    p = _run("throughput.py", "--variants", "guard,compile", "--steps", "1", "--repeats", "1",
             "--warmup", "0", "--samplers", "", "--json", timeout=1200)
    tr = _last_json(p.stdout)["training"]
    sec, first = tr["sec_per_step"], tr["first_step_sec"]
    assert set(sec) == {"guard", "compile"} and set(first) == {"compile"}  # warmup 0
    # the compile variant's first step is untimed even at --warmup 0, and reported apart
    assert tr["compile_sec"] == pytest.approx(first["compile"] - sec["compile"], rel=1e-9)
    assert first["compile"] > sec["compile"] > 0
    assert tr["speedup_compile_vs_guard"] == pytest.approx(sec["guard"] / sec["compile"],
                                                           rel=1e-9)
    assert tr["compile_mode"] == "default" and "compile (guard on" in p.stdout


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A digits checkpoint after two steps of a narrow quick-start model (seconds)."""
    out = tmp_path_factory.mktemp("bench") / "run"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "steadydiff.cli", "train", str(REPO / "configs" /
                                                                 "digits_cond.yaml"),
           "--out", str(out), "--set", "train.steps=2", "train.sample_every=0",
           "train.num_threads=1", "logging.progress=false", "logging.report=false",
           "sample.num=10", "sample.steps=2", "model.unet.channels=8",
           "model.unet.head_channels=8"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return out


def test_samplers_smoke(tiny_checkpoint):
    p = _run("samplers.py", str(tiny_checkpoint), "--num", "10", "--steps-scale", "0.01",
             "--json")
    out = _last_json(p.stdout)
    sp = out["samplers"]
    assert set(sp) == {"dpmpp_2m", "ddpm", "ddim", "euler"}
    # --steps-scale 0.01 of 20/1000/50/50 steps
    assert {k: v["steps"] for k, v in sp.items()} == \
        {"dpmpp_2m": 1, "ddpm": 10, "ddim": 1, "euler": 1}
    for v in sp.values():
        assert 0 <= v["confident_rate"] <= 1 and 0 <= v["label_accuracy"] <= 1
        assert v["class_coverage"] in range(11)  # of the 10 digit classes
        assert v["images_per_sec"] == pytest.approx(v["num"] / v["seconds"], rel=1e-9)
    ref = out["reference"]
    assert {"real_held_out", "uniform_noise", "smoothed_noise"} <= set(ref)
    # the classifier's yardsticks: held-out real digits are confidently classified, as
    # almost all of them; noise is not
    assert ref["real_held_out"]["confident_rate"] > 0.8
    assert ref["real_held_out"]["confident_rate"] > ref["uniform_noise"]["confident_rate"]
    cmp = out["dpmpp_vs_ddpm"]
    assert cmp["confident_rate_diff"] == pytest.approx(
        sp["dpmpp_2m"]["confident_rate"] - sp["ddpm"]["confident_rate"], abs=1e-12)
    assert cmp["speedup"] == pytest.approx(
        sp["dpmpp_2m"]["images_per_sec"] / sp["ddpm"]["images_per_sec"], rel=1e-9)
    assert isinstance(cmp["as_good"], bool)


def test_samplers_missing_checkpoint_says_how_to_make_it(tmp_path):
    p = _run("samplers.py", str(tmp_path / "nothing"), "--json", check=False)
    assert p.returncode == 2
    assert "make quickstart" in p.stderr


def test_stability_smoke(tmp_path):
    p = _run("stability.py", "--scenarios", "clean", "--modes", "guard,bare", "--steps", "3",
             "--out", str(tmp_path), "--json")
    out = _last_json(p.stdout)
    rows = out["scenarios"]
    assert [(r["name"], r["mode"]) for r in rows] == [("clean", "guard"), ("clean", "bare")]
    for r in rows:
        assert {"name", "mode", "finished", "finite", "eval_loss_ratio", "diagnosis_ok",
                "incidents"} <= set(r)
        assert r["finished"] and r["finite"] and r["eval_loss_ratio"] == 1.0
    assert rows[0]["diagnosis_ok"] is True and rows[0]["incidents"] == 0


@pytest.mark.slow
def test_stability_nan_batch_three_ways(tmp_path):
    """A single NaN pixel: the guard skips the batch and names it; the bare loop ends with
    NaN weights and no error (issue 3's motivating failure)."""
    p = _run("stability.py", "--scenarios", "nan_batch", "--steps", "6", "--out",
             str(tmp_path), "--json", timeout=600)
    rows = {(r["name"], r["mode"]): r for r in _last_json(p.stdout)["scenarios"]}
    g, bare = rows[("nan_batch", "guard")], rows[("nan_batch", "bare")]
    assert g["finished"] and g["finite"] and g["diagnosis_ok"]
    assert "bad_batch" in g["incident_kinds"]
    assert bare["finished"] and not bare["finite"]


def test_logging_overhead_smoke():
    p = _run("logging_overhead.py", "--steps", "2", "--repeats", "1", "--json")
    out = _last_json(p.stdout)
    med, sec = out["median_seconds"], out["seconds"]
    assert set(med) == {"default", "minimal"}
    for k in med:  # one repeat: the median is that run's time
        assert sec[k] == [med[k]] and 0 < med[k] < 120, (k, med[k])
    # the overhead is default / minimal - 1 of those runs, not a free-standing number
    assert out["overheads"] == [pytest.approx(med["default"] / med["minimal"] - 1, rel=1e-9)]
    assert out["overhead"] == out["overheads"][0] and out["overhead"] > -1
    assert math.isfinite(out["report_seconds"]) and 0 < out["report_seconds"] < 120
    assert "default logging overhead" in p.stdout


def test_eval_samplers_smoke(tiny_checkpoint, tmp_path):
    # the feature-network cache is the test session's ($STEADYDIFF_CACHE, tests/conftest.py)
    jsonl, png = tmp_path / "grid.jsonl", tmp_path / "grid.png"
    args = [str(tiny_checkpoint), "--num", "20", "--steps", "2,3", "--samplers", "ddim,euler",
            "--jsonl", str(jsonl), "--plot", str(png), "--json"]
    out = _last_json(_run("eval_samplers.py", *args).stdout)
    assert [(r["sampler"], r["steps"]) for r in out["rows"]] == \
        [("ddim", 2), ("ddim", 3), ("euler", 2), ("euler", 3)]
    assert all(r["fd"] >= 0 and 0 <= r["precision"] <= 1 for r in out["rows"])
    assert png.stat().st_size > 0 and len(jsonl.read_text().splitlines()) == 4
    again = _last_json(_run("eval_samplers.py", *args).stdout)  # resumes: nothing resampled
    assert len(jsonl.read_text().splitlines()) == 4 and len(again["rows"]) == 4


def test_eval_sanity_smoke():
    out = _last_json(_run("eval_sanity.py", "--num", "60", "--json").stdout)
    fd = {r["case"]: r["fd"] for r in out["rows"]}
    assert fd["real vs real (disjoint)"] < fd["real vs uniform noise"]
    assert out["feature_net"]["test_accuracy"] > 0.9


@pytest.mark.slow  # trains, then samples and evaluates 4 EMAs: ~40 s
def test_posthoc_ema_smoke(tmp_path):
    out = _last_json(_run(
        "posthoc_ema.py", "--configs", str(REPO / "configs/digits_cond.yaml"), "--steps", "6",
        "--every", "2", "--num", "16", "--sample-steps", "2", "--decays", "0.9,0.99",
        "--sigma-rels", "0.05,0.1", "--out", str(tmp_path / "b"), "--json", "--set",
        "model.unet.channels=8", "model.unet.head_channels=8", "model.unet.norm_groups=4",
        "train.batch_size=8", "sample.cfg_scale=1.0").stdout)
    (r,) = out["results"]
    assert r["snapshots"] == 3 and len(r["rows"]) == 4 and r["real_floor_fd"] > 0
    assert r["best_posthoc_fd"] == min(x["fd"] for x in r["rows"] if "sigma_rel" in x)
    assert r["best_fixed_fd"] == min(x["fd"] for x in r["rows"] if "decay" in x)


@pytest.mark.slow  # two cells as child processes: train, sweep 2 EMAs, judge 2: ~1 min
def test_objectives_smoke(tmp_path):
    out = _last_json(_run(
        "objectives.py", "--objectives", "flow,edm", "--seeds", "0", "--max-time", "2s",
        "--jobs", "2", "--sweep-num", "16", "--judge-num", "16", "--sigma-rels", "0.05,0.1",
        "--posthoc-every", "1", "--out", str(tmp_path / "b"), "--json", "--set",
        "model.unet.channels=8", "model.unet.head_channels=8", "model.unet.norm_groups=4",
        "train.batch_size=8", "sample.steps=2", timeout=600).stdout)
    cells = {c["objective"]: c for c in out["cells"]}
    assert set(cells) == {"flow", "edm"}
    for c in cells.values():
        assert c["steps"] >= 2 and c["time_budget"]  # the budget, not train.steps, ended it
        sw, j = c["sweep"], c["judge"]
        assert sw["picked_sigma_rel"] in (0.05, 0.1)
        assert sw["picked_fd"] == min(r["fd"] for r in sw["rows"])
        assert j["num"] == 16 and j["seed"] == 1 and j["real_floor_fd"] > 0
        assert j["run_ema"]["fd"] > 0 and j["posthoc"]["fd"] > 0
        assert c["process"]["exit"] == 0 and c["process"]["cpu_s"] > 0
        # the snapshots are removed after the sweep; its pick stays a checkpoint
        run = tmp_path / "b" / f"{c['objective']}_s0" / "run"
        assert not list((run / "posthoc").glob("step_*.safetensors"))
        assert (run / "checkpoints" / "posthoc_best").is_dir()
    best = min((c["judge"][k]["fd"], f"{o}+{k}") for o, c in cells.items()
               for k in ("run_ema", "posthoc"))[1]
    assert out["wins"] == {"0": best} and best in out["verdict"]
    assert out["grid"]["jobs"] == 2 and out["grid"]["load_avg_1m"]


def test_eval_curves_reads_eval_jsonl(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "metric": "FD-digits", "fd": 1.0 / s, "kid": 0.0, "precision": 0.9,
             "recall": 0.5, "class_accuracy": 0.8, "num": 20, "improved": True}
            for s in (10, 20)]
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _run("eval_curves.py", str(run), "--plot", str(tmp_path / "c.png"), "--json")
    assert "FD-digits" in p.stdout and (tmp_path / "c.png").stat().st_size > 0
    assert [r["step"] for r in _last_json(p.stdout)["runs"][str(run)]] == [10, 20]
    assert _run("eval_curves.py", str(tmp_path), check=False).returncode != 0


def test_grow_resolution_smoke(tmp_path):
    """Both runs (grown 16 -> 32 and 32 throughout), the feature network and the scores, on
    a 40-image stand-in for Fashion-MNIST."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_eval import make_fashion

    root = make_fashion(tmp_path / "fm")
    out = _last_json(_run("grow_resolution.py", "--out", str(tmp_path / "b"), "--path",
                          str(root), "--small-steps", "2", "--grown-steps", "1",
                          "--full-steps", "2", "--warmup", "0", "--num", "12",
                          "--featnet-steps", "2", "--sample-steps", "2", "--json").stdout)
    assert out["compute_image_pixels"] == {"grown": (2 * 256 + 1024) * 32, "full": 2 * 1024 * 32}
    assert out["grown"]["incident_kinds"][-1] == "resolution_change"
    for name in ("grown", "full"):
        assert out[name]["eval"]["num"] == 12 and out[name]["eval"]["fd"] is not None
    assert out["grown"]["eval"]["real_floor"]["fd"] is not None


def test_sd_overhead_smoke(tmp_path):
    """The SD LoRA loop bare and guarded, end to end on a small UNet: the figures are the
    medians of the per-repeat timings and their ratio, and --out holds the same JSON."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    p = _run("sd_overhead.py", "--steps", "2", "--repeats", "2", "--warmup", "1", "--batch",
             "2", "--latent-size", "8", "--device", "cpu", "--out", str(tmp_path / "sd.json"),
             "--json")
    out = _last_json(p.stdout)
    assert json.loads((tmp_path / "sd.json").read_text()) == out
    sec, reps = out["sec_per_step"], out["repeats_sec_per_step"]
    assert set(sec) == set(reps) == {"bare", "guard", "steadydiff"}
    for k, v in sec.items():
        assert len(reps[k]) == 2 and v == pytest.approx(sum(reps[k]) / 2, rel=1e-9)
        assert 0 < v < 60, (k, v)
    assert out["ratio_guard_vs_bare"] == pytest.approx(sec["guard"] / sec["bare"], rel=1e-9)
    paired = sorted(g / b for g, b in zip(reps["guard"], reps["bare"]))
    assert out["paired_ratio_guard_vs_bare"] == pytest.approx(sum(paired) / 2, rel=1e-9)
    assert out["device"] == "cpu" and out["model"]["latent_size"] == 8
    assert 0 < out["model"]["lora_params"] < out["model"]["unet_params"]
    for k, v in out["update_sec_per_step"].items():  # the update part: inside the step
        if k != "steadydiff":  # the trainer's step does not separate its update
            assert 0 < v < sec[k] and len(out["repeats_update_sec_per_step"][k]) == 2
    assert out["ratio_steadydiff_vs_bare"] == pytest.approx(sec["steadydiff"] / sec["bare"],
                                                            rel=1e-9)
    upd = out["update_sec_per_step"]
    assert out["guard_update_extra_sec"] == pytest.approx(upd["guard"] - upd["bare"], rel=1e-9)
    assert out["guard_update_extra_vs_bare_step"] == pytest.approx(
        out["guard_update_extra_sec"] / sec["bare"], rel=1e-9)
    assert "guard / bare:" in p.stdout


def test_sd_overhead_takes_a_third_variant():
    """A variant is one VARIANTS entry, build(setup) -> step(i): what the integrator adds
    for the trainer's train_step. Every variant trains on the same batches and noise."""
    pytest.importorskip("diffusers")
    sys.path.insert(0, str(BENCH))
    import sd_overhead as sd
    import torch

    s = sd.build_setup(torch.device("cpu"), batch=2, latent_size=8, data=4)
    seen: dict[str, list[float]] = {}

    def recording(name, build):
        def variant(setup, clock):
            unet, _, _ = setup.lora_unet()  # an untrained copy: what step i feeds a model
            inner = build(setup, clock)

            def step(i):
                with torch.no_grad():
                    seen.setdefault(name, []).append(setup.loss(unet, i)[0].item())
                inner(i)
            return step
        return variant

    extra = {"bare_rec": recording("bare_rec", sd.bare), "third": recording("third", sd.guard)}
    sd.VARIANTS.update(extra)
    try:
        times = sd.measure(s, ["bare_rec", "third"], steps=2, repeats=1, warmup=1)
    finally:
        for k in extra:
            sd.VARIANTS.pop(k)
    assert {k: [len(v["step"]), len(v["update"])] for k, v in times.items()} == \
        {"bare_rec": [1, 1], "third": [1, 1]}
    # step i of each variant: the same latents, text, timesteps and noise on the same init
    assert seen["bare_rec"] == seen["third"] and len(seen["third"]) == 3


def test_sd_faults_bench_runs_its_scenarios(tmp_path):
    pytest.importorskip("diffusers")
    r = subprocess.run([sys.executable, "bench/sd_faults.py", "--scenarios",
                        "nan_latents,nan_latent_at_cache", "--steps", "6", "--out",
                        str(tmp_path), "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["all_ok"] and [s["scenario"] for s in res["scenarios"]] == [
        "nan_latents", "nan_latent_at_cache"]


def test_fashion_text_smoke(tmp_path):
    """Both rows (pixel; latent, with the VAE trained, scaled and saved by the bench) on a
    120-image stand-in for Fashion-MNIST: prompt accuracy per class and overall, FD beside
    the real-vs-real floor, the VAE's reconstruction error; a second call reuses the rows."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_eval import make_fashion

    root = make_fashion(tmp_path / "fm", n_train=120, n_test=20)  # 12 per class: 2 x 5 real
    args = ["--out", str(tmp_path / "b"), "--fashion-path", str(root), "--steps", "2",
            "--num", "5", "--sample-steps", "2", "--vae-steps", "2", "--featnet-steps", "2",
            "--json"]
    out = _last_json(_run("fashion_text.py", *args).stdout)
    assert set(out["rows"]) == {"pixel", "latent"} and out["text_encoder_hidden"] == 64
    for row in out["rows"].values():
        e = row["eval"]
        assert row["train"]["steps"] == 2 and row["train"]["cpu_s"] > 0
        assert len(e["per_class"]) == 10 and e["num_per_class"] == 5 and e["cfg_scale"] == 2.0
        assert e["per_class"][7]["prompt"] == "a photo of a sneaker"
        # ten classes of equal N: the overall accuracy is the mean of the per-class ones
        assert math.isclose(e["prompt_accuracy"],
                            sum(c["prompt_accuracy"] for c in e["per_class"]) / 10)
        assert all(c["fd"] is not None and c["real_floor_fd"] is not None
                   for c in e["per_class"])
        assert Path(e["grid"]).stat().st_size > 0
    vae = out["rows"]["latent"]["vae"]
    assert vae["latent_shape"] == [4, 8, 8] and 0 < vae["test_mse_01"] < 1
    saved = json.loads((tmp_path / "b" / "vae" / "config.json").read_text())
    assert math.isclose(saved["scaling_factor"], 1 / vae["latent_std"], rel_tol=1e-6)
    assert len(out["feature_net"]["real_test"]["per_class"]) == 10
    again = _last_json(_run("fashion_text.py", *args[:-1], "--rows", "pixel", "--json").stdout)
    assert again["rows"]["pixel"] == out["rows"]["pixel"]  # reported from OUT/pixel.json


def test_gpu_bench_cpu_tiny():
    """bench/gpu.py on a CPU with tiny models: every group runs its three variants, and the
    figures are the stated functions of the timings and of the FLOP count."""
    # --steps 0: planned from a two-step probe (as on a GPU), here capped at 1
    p = _run("gpu.py", "--device", "cpu", "--tiny", "--steps", "0", "--max-steps", "1",
             "--repeats", "2", "--warmup", "0", "--json", timeout=120)
    out = _last_json(p.stdout)
    assert out["bench"] == "gpu" and out["tiny"] is True and out["skipped"] == []
    groups = out["groups"]
    assert [(g["model"], g["precision"], g["compile"]) for g in groups] == \
        [("unet", "fp32", False), ("dit", "fp32", False)]
    for g in groups:
        rows = {r["variant"]: r for r in g["variants"]}
        assert list(rows) == ["bare", "off", "guard"]
        assert g["steps_per_repeat"] == 1 and g["repeats"] == 2 and g["batch_size"] == 8
        for r in rows.values():
            assert len(r["repeats_ms_per_step"]) == 2
            assert r["ms_per_step"] == pytest.approx(statistics.median(
                r["repeats_ms_per_step"]), rel=1e-9) and 0 < r["ms_per_step"] < 60_000
            assert r["images_per_sec"] == pytest.approx(8e3 / r["ms_per_step"], rel=1e-9)
            ratio = r["ms_per_step"] / rows["bare"]["ms_per_step"]
            assert math.isfinite(r["ratio_vs_bare"]) and r["ratio_vs_bare"] == \
                pytest.approx(ratio, rel=1e-9)
            assert r["achieved_tflops"] == pytest.approx(
                g["flops_per_step"] / r["ms_per_step"] * 1e-9, rel=1e-9)
            assert r["hostsync_reads_per_step"] >= 0 and r["interventions"] == 0
            # CPU: no sync-debug count, no allocator peak, no datasheet peak for MFU
            assert r["cuda_syncs_per_step"] is None and r["peak_mib"] is None
            assert r["mfu"] is None and r["compile_source"] is None
        assert rows["bare"]["ratio_vs_bare"] == 1.0
    # FLOPs of one forward + backward of the tiny DiT (B=8, 64 tokens of width 64, depth 2):
    # 3x (2 x 12 d^2 per token of the linears) + 3.5x the attention's 4 T^2 d (FlopCounter's
    # backward counts 2.5 forwards), +2.4% for adaLN, embeddings and the final layer
    b, t, d, depth = 8, 64, 64, 2
    dominant = (6 * b * t * 12 * d * d + 14 * b * t * t * d) * depth
    assert 1.0 < out["flops_per_step"]["dit"] / dominant < 1.05
    assert out["flops_per_step"]["unet"] > 0
    assert "| variant | model | precision | compile | ms/step |" in p.stdout  # Markdown


def test_gpu_bench_peak_table_matches_device_names():
    """torch.cuda.get_device_name() strings -> the datasheet peak: the first match wins, so
    the PCIe/NVL rows must come before the SXM ones, and A10 must not take an A100."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu
    finally:
        sys.path.remove(str(BENCH))
    names = {"NVIDIA H100 80GB HBM3": 989.5, "NVIDIA H100 PCIe": 756.5,
             "NVIDIA H100 NVL": 835.5, "NVIDIA H200": 989.5, "NVIDIA A100-SXM4-80GB": 312.0,
             "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA A10": 125.0, "NVIDIA L4": 121.0,
             "NVIDIA L40S": 362.0, "NVIDIA GeForce RTX 4090": 165.2}
    for name, tflops in names.items():
        assert gpu.peak_tflops(name, "bf16") == tflops, name
    assert gpu.peak_tflops("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert gpu.peak_tflops("Tesla V100-PCIE-16GB", "fp16") == 112.0
    assert gpu.peak_tflops("Tesla V100-SXM2-32GB", "bf16") is None  # no native bf16
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3", "fp32") is None
    assert gpu.peak_tflops("Some Future GPU", "bf16") is None and gpu.peak_tflops(None, "bf16") \
        is None


def test_gpu_bench_sync_window_spans_every_period():
    """The CUDA sync count runs over a multiple of every periodic event's period, so that
    syncs per step is their long-run average and not the luck of one window."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu
    finally:
        sys.path.remove(str(BENCH))
    from steadydiff.config import replace
    for name in gpu.MODELS:
        cfg = gpu.model_cfg(name, tiny=True, batch=None, precision="fp32", device="cpu")
        n = gpu.sync_window(cfg)
        periods = [cfg.logging.log_every, cfg.guard.snapshot_every,
                   getattr(cfg.guard, "check_every", 1)]
        assert all(n % p == 0 for p in periods) or n == max(periods), (name, n, periods)
    cfg = replace(gpu.model_cfg("dit", tiny=True, batch=None, precision="fp32", device="cpu"),
                  {"logging.log_every": 25, "guard.snapshot_every": 40})
    assert gpu.sync_window(cfg) % 200 == 0 or gpu.sync_window(cfg) == 40
    cfg = replace(cfg, {"logging.log_every": 7, "guard.snapshot_every": 50})
    assert gpu.sync_window(cfg) == 50  # lcm 350 is over the cap: the longest period


@pytest.mark.slow  # two torchrun jobs of two ranks: ~40 s
def test_fsdp_memory_smoke():
    p = _run("fsdp_memory.py", "--preset", "tiny", "--worlds", "2", "--steps", "1", "--json",
             timeout=600)
    out = _last_json(p.stdout)
    by = {r["parallel"]: r for r in out["results"]}
    assert by["ddp"]["world"] == by["fsdp"]["world"] == 2
    ratio = by["fsdp"]["state_bytes"] / by["ddp"]["state_bytes"]
    assert 0.45 < ratio < 0.6, ratio  # each rank: about half of every tensor
    assert by["fsdp"]["snapshots"] < by["ddp"]["snapshots"]


@pytest.mark.slow
def test_controlnet_overhead_smoke():
    """bench/controlnet.py overhead: a diffusers-style ControlNet loop and the trainer's
    ControlNet step, side by side; the ratio is the one of the medians."""
    pytest.importorskip("diffusers")
    out = _last_json(_run("controlnet.py", "overhead", "--steps", "1", "--repeats", "2",
                          "--warmup", "1", "--batch", "2", "--latent-size", "8",
                          "--json").stdout)
    sec = out["sec_per_step"]
    assert set(sec) == {"bare", "steadydiff"} and all(0 < v < 60 for v in sec.values())
    assert out["ratio_steadydiff_vs_bare"] == pytest.approx(sec["steadydiff"] / sec["bare"])
    assert out["cpu_sec_per_step"]["bare"] > 0 and len(out["load_at_start"]) == 3


@pytest.mark.slow
def test_controlnet_learned_smoke(tmp_path):
    """bench/controlnet.py learned on a 120-image stand-in for Fashion-MNIST: base, Canny
    ControlNet, edge F1 and class accuracy with and without the control, times recorded."""
    pytest.importorskip("diffusers")
    pytest.importorskip("cv2")
    sys.path.insert(0, str(REPO / "tests"))
    from test_eval import make_fashion

    root = make_fashion(tmp_path / "fm", n_train=120, n_test=20)
    out = _last_json(_run("controlnet.py", "learned", "--out", str(tmp_path / "b"),
                          "--fashion-path", str(root), "--n-train", "32", "--num", "4",
                          "--vae-steps", "2", "--base-steps", "2", "--cn-steps", "2",
                          "--sample-steps", "2", "--featnet-steps", "2", "--batch", "4",
                          "--json").stdout)
    for k in ("with_controlnet", "base_alone"):
        s = out["score"][k]
        assert 0 <= s["f1"] <= 1 and 0 <= s["class_accuracy"] <= 1
    assert out["controlnet"]["steps"] == 2 and out["controlnet"]["cpu_s"] > 0
    assert out["data"]["canny"] == {"low": 100, "high": 200}
    assert Path(out["grid"]).is_file()


def test_flow_overhead_smoke(tmp_path):
    """bench/flow_overhead.py: diffusers' FLUX LoRA loop and the trainer's step on the family
    path, side by side on the tiny FLUX folder; the figures are the medians of the repeats
    (wall and CPU) and their ratios, both variants train the same LoRA size."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    out = _last_json(_run("flow_overhead.py", "--steps", "1", "--repeats", "2", "--warmup",
                          "1", "--batch", "2", "--data", "4", "--heads", "2", "--head-dim",
                          "8", "--layers", "1", "--single-layers", "1",
                          "--out", str(tmp_path / "f.json"), "--json").stdout)
    assert json.loads((tmp_path / "f.json").read_text()) == out
    sec, cpu = out["sec_per_step"], out["cpu_sec_per_step"]
    assert set(sec) == set(cpu) == {"bare", "steadydiff"}
    for k in sec:
        assert len(out["repeats_sec_per_step"][k]) == 2 and 0 < sec[k] < 60
        assert sec[k] == pytest.approx(statistics.median(out["repeats_sec_per_step"][k]))
        assert cpu[k] > 0
    assert out["ratio_steadydiff_vs_bare"] == pytest.approx(sec["steadydiff"] / sec["bare"])
    assert out["cpu_ratio_steadydiff_vs_bare"] == pytest.approx(cpu["steadydiff"] / cpu["bare"])
    m = out["model"]
    assert m["lora_params_bare"] == m["lora_params_steadydiff"] > 0
    assert m["latent_shape"] == [4, 16, 16] and m["t5_tokens"] == 512


def test_flow_overhead_refuses_bad_shapes():
    p = _run("flow_overhead.py", "--image-size", "30", check=False, timeout=60)
    assert p.returncode == 2 and "multiple of 4" in p.stderr


def test_flow_learns_smoke(tmp_path):
    """bench/flow_learns.py on a 120-image stand-in for Fashion-MNIST: the 16-channel VAE
    (shift and scale set as FLUX's), the FLUX.1 folder with a random transformer, a full
    fine-tune through the family path, prompt accuracy and FD beside the floor."""
    pytest.importorskip("diffusers")
    sys.path.insert(0, str(REPO / "tests"))
    from test_eval import make_fashion

    root = make_fashion(tmp_path / "fm", n_train=120, n_test=20)
    args = ["--out", str(tmp_path / "b"), "--fashion-path", str(root), "--n-train", "32",
            "--vae-steps", "2", "--steps", "2", "--batch", "4", "--warmup", "0",
            "--max-time", "none", "--num", "5",
            "--sample-steps", "2", "--featnet-steps", "2", "--heads", "2", "--head-dim", "8",
            "--layers", "1", "--single-layers", "1", "--clip", "16", "--t5", "16", "--json"]
    out = _last_json(_run("flow_learns.py", *args).stdout)
    assert out["train"]["steps"] == 2 and out["train"]["cpu_s"] > 0
    assert out["vae"]["latent_shape"] == [16, 8, 8]
    vae = json.loads((tmp_path / "b" / "vae" / "config.json").read_text())
    assert vae["shift_factor"] == pytest.approx(out["vae"]["latent_mean"])
    assert vae["scaling_factor"] == pytest.approx(1 / out["vae"]["latent_std"])
    tr = json.loads((tmp_path / "b" / "flux" / "transformer" / "config.json").read_text())
    assert tr["_class_name"] == "FluxTransformer2DModel" and tr["in_channels"] == 64
    assert tr["guidance_embeds"] is True
    e = out["eval"]
    assert e["cfg_scale"] == 1.0 and e["sampler"] == "euler"  # the family's defaults
    assert len(e["per_class"]) == 10 and e["num_per_class"] == 5
    assert math.isclose(e["prompt_accuracy"],
                        sum(c["prompt_accuracy"] for c in e["per_class"]) / 10)
    assert e["fd"] is not None and e["real_floor_fd"] is not None
    assert (tmp_path / "b" / "train.json").is_file()  # a rerun reports the run, no retraining
    assert all(0 <= r["confused_share"] <= 1 - r["prompt_accuracy"] + 1e-9
               for r in e["per_class"])  # the judge's most common other label
    c = out["ceiling"]  # the judge on real test images and on their VAE round trip
    assert c["test_images"] == 20 and len(c["per_class"]) == 10
    assert 0 <= c["vae_roundtrip_accuracy"] <= 1 and 0 <= c["real_accuracy"] <= 1
    # the kept VAE was trained at the default KL weight: another one is refused, not reused
    p = _run("flow_learns.py", *args, "--vae-kl", "1e-3", check=False, timeout=300)
    assert p.returncode == 2 and "KL weight" in p.stderr and "--vae-kl 0.001" in p.stderr


def test_flow_learns_smoke_sd3(tmp_path):
    """--family sd3: the SD3.5-shaped folder (joint blocks with QK RMS-norm over the
    16-channel VAE, CLIP-L/G + T5) trained through the family path, sampled at the SD3
    config's guidance (classifier-free, the caption dropout it trains)."""
    pytest.importorskip("diffusers")
    sys.path.insert(0, str(REPO / "tests"))
    from test_eval import make_fashion

    root = make_fashion(tmp_path / "fm", n_train=120, n_test=20)
    args = ["--family", "sd3", "--out", str(tmp_path / "b"), "--fashion-path", str(root),
            "--n-train", "32", "--vae-steps", "2", "--steps", "2", "--batch", "4",
            "--warmup", "0", "--num", "5", "--sample-steps", "2", "--featnet-steps", "2",
            "--heads", "2", "--head-dim", "8", "--layers", "1", "--single-layers", "1",
            "--clip", "16", "--t5", "16", "--json"]
    out = _last_json(_run("flow_learns.py", *args).stdout)
    tr = json.loads((tmp_path / "b" / "sd3" / "transformer" / "config.json").read_text())
    assert tr["_class_name"] == "SD3Transformer2DModel" and tr["in_channels"] == 16
    assert tr["qk_norm"] == "rms_norm" and tr["num_layers"] == 2
    e = out["eval"]
    assert out["recipe"]["family"] == "sd3.5" and e["cfg_scale"] > 1.0
    assert len(e["per_class"]) == 10 and e["fd"] is not None
