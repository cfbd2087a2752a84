"""Config validation: unknown keys, wrong types and out-of-range values name the key."""

from pathlib import Path

import pytest
import yaml

from steadydiff.config import (STABLE_KEYS, Config, ConfigError, FaultConfig, FrozenConfigError,
                               GuardConfig, apply_overrides, config_diff, load_config, replace,
                               validate)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    """Every shipped config validates, and every value it sets is the value the resolved
    config holds (none lands on a default), and the printed YAML reloads to the same."""
    cfg = load_config(path)
    resolved = cfg.to_dict()

    def leaves(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    written = dict(leaves(yaml.safe_load(path.read_text())))
    assert written, path
    for key, value in written.items():
        got = resolved
        for part in key.split("."):
            got = got[part]
        # YAML 1.1 reads 2e-4 (no dot) as a string; the typed config makes it a float
        if isinstance(got, float) and isinstance(value, (str, int)):
            value = float(value)
        assert got == value, f"{path.name}: {key} = {value!r} in the file, {got!r} resolved"
    assert validate(yaml.safe_load(cfg.to_yaml())) == cfg


def test_stable_keys_exist():
    raw = Config().to_dict()
    for key in STABLE_KEYS:
        node = raw
        for part in key.split("."):
            assert part in node, key
            node = node[part]


def test_overrides_are_typed():
    cfg = load_config(None, ["train.steps=7", "optim.lr=1e-3", "model.unet.channel_mult=[1,2]",
                             "data.path=null", "train.deterministic=true"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-3
    assert cfg.model.unet.channel_mult == (1, 2) and cfg.train.deterministic is True


@pytest.mark.parametrize("override, expected", [
    ("train.stepz=5", "train.stepz: unknown key; did you mean 'train.steps'?"),
    ("model.unet.chanels=8", "did you mean 'model.unet.channels'?"),
    ("traine.steps=5", "did you mean 'train'?"),
    ("optim.lr=-1", "optim.lr: Input should be greater than 0, got -1 (expected float, > 0.0"),
    ("train.batch_size=abc", "train.batch_size: Input should be a valid integer"),
    ("model.kind=vit", "model.kind: Input should be 'unet' or 'dit'"),
    ("train.precision=fp8", "'fp32', 'bf16' or 'fp16'"),
    ("diffusion.cfg_dropout=1.5", "diffusion.cfg_dropout"),
])
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


def test_cross_field_errors_say_what_to_change():
    with pytest.raises(ConfigError, match="must be divisible by train.grad_accum"):
        load_config(None, ["train.batch_size=10", "train.grad_accum=3"])
    with pytest.raises(ConfigError, match="data.path is required"):
        load_config(None, ["data.dataset=folder"])
    with pytest.raises(ConfigError, match="beta_end .* must be greater"):
        load_config(None, ["diffusion.beta_start=0.1", "diffusion.beta_end=0.01"])


@pytest.mark.parametrize("overrides, expected", [
    (["diffusion.objective=rf"], "diffusion.objective: Input should be 'ddpm', 'flow' or 'edm'"),
    (["diffusion.objective=flow", "diffusion.zero_terminal_snr=true"],
     "diffusion.zero_terminal_snr belongs to diffusion.objective=ddpm's schedule and "
     "prediction; diffusion.objective=flow does not use it (flow reaches pure noise at "
     "sigma = 1 by construction"),
    (["diffusion.objective=edm", "diffusion.prediction=v"],
     "diffusion.prediction belongs to diffusion.objective=ddpm's"),
    (["diffusion.objective=flow", "diffusion.resolution_shift_base=16"],
     "set diffusion.flow.shift or diffusion.flow.dynamic_shift"),
    (["diffusion.objective=flow", "diffusion.schedule=cosine"], "remove diffusion.schedule"),
    (["diffusion.objective=flow", "diffusion.loss_weighting=min_snr"],
     "diffusion.loss_weighting=min_snr does not apply to diffusion.objective=flow; valid: "
     "uniform, sigma_sqrt, cosmap"),
    (["diffusion.loss_weighting=cosmap"], "valid: uniform, min_snr"),
    (["diffusion.objective=edm", "diffusion.loss_weighting=sigma_sqrt"], "valid: uniform"),
    (["diffusion.objective=edm", "diffusion.timestep_sampling=logit_normal"],
     "edm draws ln(sigma) ~ N(diffusion.edm.p_mean, diffusion.edm.p_std^2)"),
    (["diffusion.flow.shift=3.0"], "diffusion.flow.shift configure diffusion.objective=flow, "
     "but the objective is ddpm"),
    (["diffusion.objective=flow", "diffusion.edm.p_mean=-0.4", "diffusion.edm.rho=5"],
     "diffusion.edm.p_mean, diffusion.edm.rho configure diffusion.objective=edm"),
    (["diffusion.objective=flow", "diffusion.flow.shift=3", "diffusion.flow.dynamic_shift=true"],
     "both shift the noise levels"),
    (["diffusion.objective=flow", "diffusion.flow.max_seq_len=100"],
     "diffusion.flow.max_seq_len (100) must be greater than diffusion.flow.base_seq_len (256)"),
    (["diffusion.objective=edm", "diffusion.edm.sigma_min=90"],
     "diffusion.edm.sigma_min (90.0) must be less than diffusion.edm.sigma_max (80.0)"),
    (["diffusion.flow.shift=0"], "diffusion.flow.shift: Input should be greater than 0"),
    (["sample.sampler=heun"], "sample.sampler=heun does not apply to diffusion.objective=ddpm; "
     "valid: ddpm, ddim, dpmpp_2m, euler"),
    # a pretrained model's folder decides its objective (ddpm: SD/SDXL, flow: SD3/FLUX.1,
    # set by its family's recipe); none trains EDM
    (["diffusion.objective=edm", "model.pretrained=/x", "data.captions=auto",
      "data.dataset=folder", "data.path=/x"], "a pretrained model trains with the objective "
     "its scheduler folder describes"),
])
def test_objective_combinations_are_refused_by_name(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value)


def test_objectives_validate_with_their_keys():
    cfg = load_config(None, ["diffusion.objective=flow", "diffusion.flow.shift=3",
                             "diffusion.loss_weighting=cosmap", "diffusion.timestep_sampling=mode",
                             "sample.sampler=heun"])
    assert cfg.diffusion.flow.shift == 3.0 and cfg.sample.sampler == "heun"
    cfg = load_config(None, ["diffusion.objective=edm", "diffusion.edm.sigma_data=0.4",
                             "sample.sampler=dpmpp_2m"])
    assert cfg.diffusion.edm.sigma_data == 0.4


def test_malformed_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides({}, ["train.steps"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"train": 3}, ["train.steps=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad)


def test_yaml_round_trip_and_diff(tmp_path):
    cfg = load_config(None, ["train.steps=3"])
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    again = load_config(p)
    assert again == cfg
    changed = load_config(p, ["optim.lr=0.5", "model.unet.channels=8"])
    assert config_diff(cfg, changed) == [("model.unet.channels", 64, 8), ("optim.lr", 2e-4, 0.5)]


# --------------------------------------------------------------------------- frozen


def test_a_validated_config_is_read_only():
    cfg = load_config(None, ["train.steps=7"])
    with pytest.raises(FrozenConfigError, match=r"train\.steps: a validated config is read-only"
                                                r".*replace\(cfg, \{'train\.steps': 5\}\)"):
        cfg.train.steps = 5
    with pytest.raises(FrozenConfigError, match="model.unet.channels"):
        cfg.model.unet.channels = 8
    with pytest.raises(FrozenConfigError, match="^guard: "):
        cfg.guard = GuardConfig()
    with pytest.raises(AttributeError):  # lists are tuples: no in-place append
        cfg.model.unet.channel_mult.append(4)
    with_fault = load_config(None, ["faults=[{kind: oom, step: 3}]"])
    with pytest.raises(FrozenConfigError, match="FaultConfig.step"):
        with_fault.faults[0].step = 4
    assert cfg.train.steps == 7 and cfg.model.unet.channel_mult == (1, 2, 2)
    assert hash(cfg) == hash(load_config(None, ["train.steps=7"]))  # a value: hashable


def test_replace_derives_a_validated_copy():
    cfg = load_config(None, ["train.steps=7", "diffusion.cfg_dropout=0.2"])
    new = replace(cfg, {"train.steps": 9, "model.unet.channel_mult": [1, 2]})
    assert (new.train.steps, new.model.unet.channel_mult) == (9, (1, 2))
    assert cfg.train.steps == 7 and cfg.model.unet.channel_mult == (1, 2, 2)  # untouched
    assert config_diff(cfg, new) == [("model.unet.channel_mult", [1, 2, 2], [1, 2]),
                                     ("train.steps", 7, 9)]
    # --set strings work too, and the keys the user set stay set (lint reads them)
    same = replace(cfg, ["train.steps=9", "model.unet.channel_mult=[1,2]"])
    assert same == new and "cfg_dropout" in same.diffusion.model_fields_set
    assert "ema_decay" not in same.train.model_fields_set
    faults = replace(cfg, {"faults": [FaultConfig(kind="kill", step=2),
                                      {"kind": "oom", "step": 1}]})
    assert [f.kind for f in faults.faults] == ["kill", "oom"]
    # the copy is validated: types, ranges, cross-field rules and typos are errors
    with pytest.raises(ConfigError, match="train.steps: Input should be greater than"):
        replace(cfg, {"train.steps": 0})
    with pytest.raises(ConfigError, match="must be divisible by train.grad_accum"):
        replace(cfg, {"train.grad_accum": 3})
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        replace(cfg, ["train.stepz=3"])


def test_round_trip_keeps_types_and_the_printed_config(tmp_path):
    """to_dict / to_yaml -> validate gives the same config, with the Literal values and
    tuples intact, and the YAML printed at start (and saved as config.yaml) is plain YAML:
    lists, no Python tuples."""
    cfg = load_config(Path(__file__).parent.parent / "configs" / "digits_cond.yaml",
                      ["faults=[{kind: oom, step: 3}]", "diffusion.schedule=piecewise",
                       "data.classes=[1,2]", "adapter.targets=['*.attn.qkv']"])
    assert validate(cfg.to_dict()) == cfg
    text = cfg.to_yaml()
    again = validate(yaml.safe_load(text))
    assert again == cfg and again.to_yaml() == text
    assert "!!python" not in text and "channel_mult:\n" in text
    raw = yaml.safe_load(text)
    assert raw["diffusion"]["piecewise"] == [[0.0, 10.0], [1.0, -10.0]]
    assert raw["faults"] == [{"kind": "oom", "step": 3, "factor": None, "steps": 1,
                              "index": None,
                              "target": None, "where": "in_step", "rank": None}]
    assert isinstance(again.data.classes, tuple) and again.faults[0].kind == "oom"
