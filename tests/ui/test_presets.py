"""Preset files (ui/presets.py), without Qt: what is written reads back the same, comments anywhere are read past, and
a file that is not a preset is one PresetError saying why."""

from __future__ import annotations

import tomllib

import pytest

from engine.config import CacheConfig
from engine.telemetry.health import HealthTargets
from ui.presets import PresetError, preset_text, read_preset, write_preset


def test_a_written_preset_reads_back_the_same(tmp_path):
    knobs = CacheConfig(block_size=8, kv_dtype="int8", device_budget_mb=48.5, policy="s3fifo").as_dict()
    targets = HealthTargets(prefix_hit_rate=0.8, block_utilization=0.5, eviction_rate=0.02)
    path = str(tmp_path / "p.toml")
    write_preset(path, knobs, targets)
    text = open(path, encoding="utf-8").read()
    assert text.startswith("# KV Scope cache preset\n") and "\n[health]\n" in text and 'kv_dtype = "int8"' in text
    preset = read_preset(path)
    assert preset.knobs == knobs and preset.targets == targets
    assert CacheConfig().replace(**preset.knobs) == CacheConfig().replace(**knobs)


def test_a_comment_after_the_table_header_reads(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text('# KV Scope cache preset\nblock_size = 16\nkv_dtype = "fp16"\ndevice_budget_mb = 256.0\n'
                    "\n[health]  # the health strip's targets, shares (0.75 = 75 %)\nprefix_hit_rate = 0.75\n"
                    "block_utilization = 0.6\neviction_rate = 0.05\n")
    preset = read_preset(str(path))
    assert preset.knobs == {"block_size": 16, "kv_dtype": "fp16", "device_budget_mb": 256.0}
    assert preset.targets == HealthTargets()


def test_knobs_alone_and_targets_alone(tmp_path):
    (tmp_path / "k.toml").write_text("decay = 0.5\n")
    (tmp_path / "t.toml").write_text("[health]\neviction_rate = 0.1\n")
    assert read_preset(str(tmp_path / "k.toml")).targets is None
    only = read_preset(str(tmp_path / "t.toml"))
    assert only.knobs == {} and only.targets == HealthTargets(eviction_rate=0.1)


@pytest.mark.parametrize("text, why", [
    ("block_size = = 3\n", "Invalid value"),
    ("health = 3\n", "health: expected a [health] table of targets"),
    ("[health]\neviction_rate = 3\n", "health target eviction_rate: 3 is not a share between 0 and 1"),
    ("[health]\nspeed = 0.5\n", "unknown health target 'speed'"),
])
def test_what_is_not_a_preset_says_why_without_the_path(tmp_path, text, why):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PresetError) as e:
        read_preset(str(path))
    assert why in str(e.value) and str(path) not in str(e.value)


def test_bytes_that_are_not_utf8_are_refused(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'policy = "h\xe9at"\n')
    with pytest.raises(PresetError, match="utf-8"):
        read_preset(str(path))


def test_the_text_is_toml_with_the_targets_in_their_table():
    data = tomllib.loads(preset_text(CacheConfig().as_dict(), HealthTargets()))
    assert data.pop("health") == HealthTargets().as_dict() and data == CacheConfig().as_dict()
