"""Each optimizer's settings (thinwire.train.settings): documented field by field, a flag per
field named after its optimizer, the flag reaching the optimizer, the old flags still taken,
and the flat record a checkpoint keeps read back into the same settings."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from thinwire.train.checkpoint import CheckpointError, check, expected_meta
from thinwire.train.cli import build_parser, config_from_args
from thinwire.train.config import RENAMED, get_preset
from thinwire.train.model import build_model
from thinwire.train.optimizers import OPTIMIZERS, get_optimizer
from thinwire.train.settings import (LoRDOSettings, PowerSGDSettings, Settings, field_docs,
                                     flat_fields, flat_key)

CLASSES = list(Settings.KNOWN.values())


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.PREFIX)
def test_every_field_has_a_docstring_and_a_flag_named_after_its_optimizer(cls, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare", "--help"])
    docs, help_text = field_docs(cls), capsys.readouterr().out
    assert f"{cls.PREFIX} settings:" in help_text
    for f in fields(cls):
        assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name} has no docstring"
        assert f"--{cls.PREFIX}-{f.name.replace('_', '-')}" in help_text


def test_every_thinwire_optimizer_in_the_registry_names_its_settings():
    for name, spec in OPTIMIZERS.items():
        if not spec.dense and name != "powersgd":
            assert spec.settings is not None and spec.settings in CLASSES, name
    assert {spec.settings for spec in OPTIMIZERS.values() if spec.settings} == set(CLASSES)


def _cfg(*argv):
    return config_from_args(build_parser().parse_args(["compare", "--preset", "tiny", *argv]))


def test_a_flag_reaches_its_optimizer_and_no_other():
    cfg = _cfg("--lordo-rank", "3", "--ef21-muon-uplink", "topk:0.25", "--powersgd-rank", "2")
    assert cfg.settings(LoRDOSettings).rank == 3 and cfg.settings(PowerSGDSettings).rank == 2
    lordo = get_optimizer("lordo").build(build_model(cfg), cfg, 1e-3).optimizer
    assert {g["rank"] for g in lordo.param_groups} == {3}
    ef21 = get_optimizer("ef21-muon").build(build_model(cfg), cfg, 1e-3).optimizer
    assert repr(ef21.uplink) == "TopK('topk:0.25')"


def test_the_old_flags_still_set_the_renamed_fields(capsys):
    cfg = _cfg("--topk", "7", "--lowrank", "5", "--compressed-after", "0.5")
    record = cfg.record()
    assert (record["demo_topk"], record["lordo_rank"], record["apmsqueeze_compressed_after"]) == (7, 5, 0.5)
    err = capsys.readouterr().err
    assert "--topk is now --demo-topk" in err and "--lowrank is now --lordo-rank" in err
    assert set(RENAMED.values()) <= set(flat_fields())


def test_the_record_reads_back_into_the_same_settings():
    cfg = get_preset("small", demo_values="fp32", sparseloco_topk=64, diloco_outer_lr=0.5)
    flat = {k: v for k, v in cfg.record().items() if k in flat_fields()}
    again = get_preset("small", **flat)
    for cls in CLASSES:
        assert again.settings(cls) == cfg.settings(cls), cls.PREFIX
    assert flat[flat_key(LoRDOSettings, "rank")] == 0


def test_an_unknown_setting_is_named():
    with pytest.raises(ValueError, match="unknown config fields: \\['demo_topkk'\\]"):
        get_preset("tiny", demo_topkk=3)


# ---- the median-norm clip (thinwire.optim.median_clip) through the harness ----

CLIPPED = ("demo", "demo-overlap", "demo-lookahead", "sparseloco", "sparseloco-delayed")


def test_the_clip_flags_reach_demo_and_sparseloco():
    cfg = _cfg("--demo-clip", "median-norm", "--sparseloco-clip", "median-norm")
    assert (cfg.record()["demo_clip"], cfg.record()["sparseloco_clip"]) == ("median-norm", "median-norm")
    default = _cfg()
    for name in CLIPPED:
        assert get_optimizer(name).build(build_model(cfg), cfg, 1e-3).optimizer.clip == "median-norm", name
        assert get_optimizer(name).build(build_model(default), default, 1e-3).optimizer.clip is None, name


@pytest.mark.parametrize("flat, message", [
    ({"demo_clip": "median"}, r"demo: clip must be one of none, median-norm, got 'median' \(--demo-clip\)"),
    ({"sparseloco_clip": "None"},
     r"sparseloco: clip must be one of none, median-norm, got 'None' \(--sparseloco-clip\)"),
    ({"sparseloco_clip": "median-norm", "sparseloco_values": "fp32"},     # SparseLoCo's own refusal, flag named
     r"sparseloco: clip='median-norm' runs on the grouped path.*\(--sparseloco-clip\)"),
])
def test_a_bad_clip_is_refused_naming_the_flag(flat, message):
    with pytest.raises(ValueError, match=message):
        get_preset("tiny", **flat)


def test_a_checkpoint_from_before_the_clip_resumes_and_a_clipped_run_does_not(tmp_path):
    """A checkpoint's config written before the clip settings existed ran without a clip (the
    default 'none'): a run without one resumes it, a clipped run is refused naming the key."""
    cfg = get_preset("tiny")
    meta = {"step": 4, **expected_meta(cfg, "demo", 3e-3, 2)}
    for key in ("demo_clip", "sparseloco_clip"):
        del meta["config"][key]
    (tmp_path / "thinwire.json").write_text(json.dumps(meta))
    assert check(tmp_path, expected_meta(cfg, "demo", 3e-3, 2))["step"] == 4
    with pytest.raises(CheckpointError, match=r"demo_clip: checkpoint 'none', this run 'median-norm'"):
        check(tmp_path, expected_meta(cfg.with_settings(demo_clip="median-norm"), "demo", 3e-3, 2))
