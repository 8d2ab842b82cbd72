"""KVCACHED_DEVICE_HEADROOM parsed once, and an engine's working memory published in its segment."""

from __future__ import annotations

import pytest

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.settings import ConfigError, DeviceHeadroom, Settings

GiB = 1 << 30


@pytest.mark.parametrize(("raw", "expected"), [
    ("", DeviceHeadroom(percent=5.0)),  # the default: what the public kvcached's 0.95 utilization leaves
    ("5%", DeviceHeadroom(percent=5.0)),
    ("12.5 %", DeviceHeadroom(percent=12.5)),
    ("0.05", DeviceHeadroom(percent=5.0)),
    (".25", DeviceHeadroom(percent=25.0)),
    ("4GiB", DeviceHeadroom(size_bytes=4 * GiB)),
    ("512M", DeviceHeadroom(size_bytes=512 << 20)),
    ("0", DeviceHeadroom(size_bytes=0)),
    ("0%", DeviceHeadroom(size_bytes=0)),
    ("0B", DeviceHeadroom(size_bytes=0)),
    ("none", DeviceHeadroom(size_bytes=0)),
    ("off", DeviceHeadroom(size_bytes=0)),
])
def test_headroom_setting(raw: str, expected: DeviceHeadroom) -> None:
    assert Settings.from_env({"KVCACHED_DEVICE_HEADROOM": raw}).device_headroom == expected


@pytest.mark.parametrize(("raw", "words"), [
    ("2", "a bare number is a fraction of the device, below 1 (2GiB for a size, 2% for a percentage)"),
    ("1", "a bare number is a fraction of the device"),
    ("100%", "must be from 0 (off) to below 100% of the device"),
    ("-5%", "must be from 0 (off) to below 100% of the device"),
    ("-0.1", "must be from 0 (off) to below 100% of the device"),
    ("x%", "is not a percentage"),
    ("lots", "is not a size"),
    ("-1GiB", "a size cannot be negative"),
    ("4XB", "unknown unit"),
    ("unlimited", "'unlimited' is not a size here"),  # a size's word for no limit is not a headroom's for none
])
def test_a_bad_headroom_is_one_error_naming_the_variable(raw: str, words: str) -> None:
    parsed = Settings.from_env({"KVCACHED_DEVICE_HEADROOM": raw})  # refused when used, not before
    with pytest.raises(ConfigError, match="KVCACHED_DEVICE_HEADROOM") as caught:
        parsed.device_headroom  # noqa: B018
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_headroom_of_a_device() -> None:
    assert DeviceHeadroom(percent=5.0).of(80 * GiB) == 4 * GiB
    assert DeviceHeadroom(size_bytes=3 * GiB).of(80 * GiB) == 3 * GiB
    assert DeviceHeadroom(size_bytes=0).of(80 * GiB) == 0


SMALL = dict(num_blocks=64, block_bytes=64 * 1024, num_layers=2, page_size=2 << 20)


def _words(name: str, shm_dir) -> tuple[int, int]:
    raw = (shm_dir / f"kvc.{name}").read_bytes()
    return L.U64.unpack_from(raw, L.WORKING_PEAK_OFF)[0], L.U64.unpack_from(raw, L.WORKING_NOW_OFF)[0]


def test_working_memory_is_published_beside_the_claim(shm_dir) -> None:
    with kc.KVCacheManager("work", name="work", **SMALL) as m:
        assert _words("work", shm_dir) == (0, 0)
        m.register_working_memory(3 * GiB)
        assert _words("work", shm_dir) == (3 * GiB, 0)
        m.register_working_memory(3 * GiB, now_bytes=2 * GiB)
        assert _words("work", shm_dir) == (3 * GiB, 2 * GiB)


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", True, 1 << 63])
def test_a_bad_working_memory_figure_is_refused_and_changes_nothing(shm_dir, bad) -> None:
    with kc.KVCacheManager("work", name="work", **SMALL) as m:
        m.register_working_memory(GiB, now_bytes=GiB // 2)
        with pytest.raises(ValueError, match="peak_bytes must be a whole number of bytes"):
            m.register_working_memory(bad)
        with pytest.raises(ValueError, match="now_bytes must be a whole number of bytes"):
            m.register_working_memory(GiB, now_bytes=bad)
        assert _words("work", shm_dir) == (GiB, GiB // 2)
