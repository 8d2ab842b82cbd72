"""The allocator under adversity: handlers that fail, engines that misuse sleep, calls after close."""

from __future__ import annotations

import pytest

from kvcached_core import KVCacheManager

MiB = 1024 * 1024
SMALL = dict(num_blocks=64, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)


def test_sleep_and_wake_after_close_say_the_manager_is_closed() -> None:
    m = KVCacheManager("closed", **SMALL)  # type: ignore[arg-type]
    m.set_sleep_handler(lambda action: None)
    m.close()
    for call in (m.sleep.sleep, m.sleep.wake, m.sleep.ready, lambda: m.set_sleep_handler(None)):
        with pytest.raises(RuntimeError, match="'closed' is closed"):
            call()
