"""PREFT_LORA_TILES: the kernels' launch shapes from the engine's environment, checked before any launch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from preft.vllm_plugin.tiles import DEFAULT_TILES, Tiles, parse_tiles


def test_labels_round_trip_and_leave_out_warps_and_stages():
    tiles = Tiles(rows=32, cols=256, warps=8, stages=2)
    assert Tiles.parse(tiles.label) == tiles and tiles.label == "32x256 w8 s2"
    assert Tiles.parse(" 64x64") == Tiles(64, 64, 4, 3) and Tiles.parse("16x32w2") == Tiles(16, 32, 2, 3)
    ordered = Tiles(rows=64, cols=128, warps=8, stages=3, cols_first=True)
    assert Tiles.parse(ordered.label) == ordered and ordered.label == "64x128 w8 s3 cols-first"
    assert Tiles.parse("32x64 cols-first") == Tiles(32, 64, 4, 3, cols_first=True)


def test_setting_names_either_kernel_or_both():
    assert parse_tiles("") == {}
    assert parse_tiles("expand=64x128 w8 s3") == {"expand": Tiles(64, 128, 8, 3)}
    assert parse_tiles(" shrink=32x64 w4 s4 , expand=16x32 ") == {
        "shrink": Tiles(32, 64, 4, 4),
        "expand": Tiles(16, 32, 4, 3),
    }
    assert parse_tiles("act=32x64 w4 s1 cols-first")["act"].cols_first


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("fused=64x64", "not shrink=LABEL, expand=LABEL or act=LABEL"),
        ("64x64", "not shrink=LABEL, expand=LABEL or act=LABEL"),
        ("shrink=64x64,shrink=32x32", "given twice"),
        ("expand=64", "is not ROWSxCOLS"),
        ("expand=48x64", "rows must be a power of two from 16 to 128, not 48"),
        ("shrink=256x64", "rows must be a power of two from 16 to 128, not 256"),
        ("expand=64x512", "cols must be a power of two from 16 to 256, not 512"),
        ("shrink=64x64 w3", "warps must be a power of two"),
        ("shrink=64x64 w4 s0", "stages must be 1 to 8"),
        ("expand=64x64 colsfirst", "is not ROWSxCOLS"),
        ("shrink=64x64 cols-first", "the shrink's grid has one order"),
    ],
)
def test_bad_settings_say_what_is_wrong(setting, message):
    with pytest.raises(ValueError, match=message):
        parse_tiles(setting)


def test_the_environment_sets_the_shapes_when_the_settings_load_and_a_bad_one_stops_it():
    code = (
        "from preft.vllm_plugin import settings; tiles = settings.current().lora_tiles; "
        "print(tiles['expand'].label, tiles['shrink'].label)"
    )
    env = {**os.environ, "PREFT_LORA_TILES": "expand=32x128 w4 s2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[0] == f"32x128 w4 s2 {DEFAULT_TILES['shrink'].label}", done.stderr
    env["PREFT_LORA_TILES"] = "expand=32x100"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "cols must be a power of two" in done.stderr
