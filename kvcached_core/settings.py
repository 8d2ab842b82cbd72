"""Every environment variable the project reads: declared once here, parsed and validated once.

:data:`VARIABLES` names each variable with its default, type and meaning (docs/environment.md
is generated from it: ``python -m kvcached_core.settings``). :func:`settings` returns the
:class:`Settings` for the current environment, parsed once and kept until a variable changes
(so a launcher or a test may set one per process). A bad value is one :class:`ConfigError`
naming the variable, raised when that setting is used, so a command that does not need it
still runs.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .bounds import PRIORITY_MAX, PRIORITY_MIN, endpoint_problem
from .hostmem import total_ram_bytes
from .sizes import SizeError, parse_size

MiB = 1024 * 1024
PAGE_GRAIN = 2 * MiB  # a page size is a whole number of these (the CUDA backend's mapping granularity)


class ConfigError(ValueError):
    """An environment variable holds a value we cannot use."""


@dataclass(frozen=True)
class Var:
    """One environment variable: ``default`` is the raw value used when it is unset or empty
    (None: no value), ``shown`` the default as the reference writes it when it is not that."""

    name: str
    default: str | None
    type: str
    meaning: str
    shown: str | None = None

    @property
    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        return "unset" if self.default is None else f"`{self.default}`"


POLICIES = ("first-fit", "best-fit", "affinity")  # placement.POLICIES, in its order
CUDA_LAYOUTS = ("layer", "page")
TP_STRATEGIES = ("sequential", "concurrent")
HOST_CAPACITY_FRACTION = 0.5  # of RAM, the host backend's budget unless KVCACHED_HOST_CAPACITY says
_TRISTATE = {"auto": "auto", "1": "on", "on": "on", "true": "on", "yes": "on",
             "0": "off", "off": "off", "false": "off", "no": "off"}
_HEADROOM_OFF = ("none", "off")  # KVCACHED_DEVICE_HEADROOM's words for 0
_FRACTION_RE = re.compile(r"^\s*-?(\d+(\.\d*)?|\.\d+)\s*$")  # a bare number: KVCACHED_DEVICE_HEADROOM's fraction
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

VARIABLES: tuple[Var, ...] = (
    Var("KVCACHED_SHM_DIR", "/dev/shm", "path",
        "where segments live; every reader and writer on a host must agree on it (a missing or "
        "non-directory path fails every kvctl command and `kvtop --once`, exit 1)"),
    Var("KVCACHED_PAGE_SIZE_MB", "2", "integer", "page size in MiB (a positive multiple of 2)"),
    Var("KVCACHED_MIN_RESERVED_PAGES", "5", "integer",
        "the reserve pool is refilled up to this by a background thread (the CUDA page layout maps "
        "four page ids per refill, up to the maximum)"),
    Var("KVCACHED_MAX_RESERVED_PAGES", "10", "integer", "freed pages beyond this are unmapped at once"),
    Var("KVCACHED_MAX_CACHED_TOKENS", "16000", "integer",
        "prefix-cache budget: `<0` unlimited, `0` off, `>0` cap (at least one block)"),
    Var("KVCACHED_MAX_CACHED_BLOCKS", None, "integer", "the same budget in blocks; wins when set"),
    Var("KVCACHED_HOST_CAPACITY", None, "size",
        "host backend capacity shared by all models (`8GiB`, `25%`)", shown="half of RAM"),
    Var("KVCACHED_DEVICE_BUDGET", None, "size",
        "CUDA backend: the KV budget of each device, shared by every allocator on it (`60GiB`, `80%` of the "
        "device's memory); a growth past it is refused as the driver's out-of-memory would be",
        shown="none: the driver's out-of-memory"),
    Var("KVCACHED_DEVICE_HEADROOM", "5%", "size",
        "CUDA backend: device memory KV never takes, beside the engines' registered working memory (`5%` or "
        "`0.05` of the device's memory, `4GiB`; `0`, `none` or `off`: off): a growth that would leave less free is refused as the "
        "budget refuses one, with or without `KVCACHED_DEVICE_BUDGET` ([cuda.md](cuda.md#headroom))"),
    Var("KVCACHED_MIN", None, "size",
        "a model's memory.min under pressure: bytes never reclaimed from it by another model's refused growth "
        "(`4GiB`, `none`); live: `kvctl policy MODEL --min`", shown="none"),
    Var("KVCACHED_PRIORITY", "0", "integer",
        "who gives first when a device's budget is short: lower gives first (-1000..1000); live: "
        "`kvctl policy MODEL --priority`"),
    Var("KVCACHED_POLICY", "affinity", "choice",
        "placement and eviction policy: `affinity`, `best-fit` (the public kvcached's) or `first-fit`"),
    Var("KVCACHED_IDLE_RETURN_S", "10", "number",
        "seconds without traffic after which a model unmaps its warm pool (`<0` never)"),
    Var("KVCACHED_IPC_NAME", None, "name",
        "segment name override (the public kvcached's segments are found by their struct whatever their name)",
        shown="the model name"),
    Var("KVCACHED_CUDA_LAYOUT", "layer", "choice",
        "CUDA backend: `layer` (one single-stride tensor per layer and buffer) or `page` (one handle per "
        "page id, much faster growth: [cuda.md](cuda.md))"),
    Var("KVCACHED_CUDA_POOL_PAGES", None, "integer",
        "CUDA backend: page ids' worth of unmapped physical handles kept for regrowth",
        shown="`KVCACHED_MAX_RESERVED_PAGES`"),
    Var("KVCACHED_CUDA_ASYNC_UNMAP", "1", "boolean",
        "CUDA backend: unmap in a backend thread (`0`: in the caller)"),
    Var("KVCACHED_CUDA_UNMAP_DELAY_MS", "20", "number",
        "CUDA backend: how long a freed page waits before it is unmapped (taken back for free meanwhile)"),
    Var("KVCACHED_CUDA_NATIVE", "auto", "auto/1/0",
        "CUDA backend: map page ids with the C loop built at install, in both layouts (`0` never, `1` required)"),
    Var("KVCACHED_FASTPATH", "auto", "auto/1/0",
        "`alloc` and `free` in C (built at install; `0` never, `1` required): the same blocks and bytes "
        "as the Python path (speed: `python -m benchmarks --only hotpath`)"),
    Var("KVCACHED_TP_STRATEGY", "concurrent", "choice",
        "tensor parallel: send to every rank, then collect (`sequential`: one rank after another)"),
    Var("KVCACHED_TP_TIMEOUT_S", "10", "number",
        "tensor parallel: a rank that does not answer a map or unmap within this is lost"),
    Var("KVCACHED_ENDPOINT", None, "url",
        "where the engine serves its model (`http://HOST:PORT`), published in its segment for `kvctl route`; "
        "the vLLM plugin sets it from vLLM's `--host`/`--port` itself"),
    Var("KVCTL_DEBUG", None, "flag", "kvctl: show the traceback of an internal error instead of its one line"),
    Var("KVCTL_ROUTE_API_KEY", None, "secret",
        "`kvctl route`: the key every request must carry (`Authorization: Bearer KEY`); unlike `--api-key`, "
        "not shown in `ps` ([kvctl.md](kvctl.md#kvctl-route))"),
    Var("ENABLE_KVCACHED", None, "boolean",
        "the vLLM plugin: `true` (or `1`, `yes`, `on`) lets kvcached hold vLLM's KV cache; unset or "
        "false leaves vLLM alone ([engines.md](engines.md#vllm))"),
)
BY_NAME: dict[str, Var] = {v.name: v for v in VARIABLES}


def default_of(name: str) -> str:
    """The declared default of a variable that has one."""
    value = BY_NAME[name].default
    if value is None:
        raise KeyError(f"{name} has no default value")
    return value


@dataclass(frozen=True)
class DeviceShare:
    """A fixed size, or a percentage of each device's memory."""

    size_bytes: int | None = None
    percent: float | None = None

    def of(self, device_total: int) -> int:
        """The bytes on a device of ``device_total`` bytes."""
        if self.size_bytes is not None:
            return self.size_bytes
        assert self.percent is not None
        return int(device_total * self.percent / 100)


class DeviceBudget(DeviceShare):
    """``KVCACHED_DEVICE_BUDGET``: the KV budget of each device, shared by its allocators."""


class DeviceHeadroom(DeviceShare):
    """``KVCACHED_DEVICE_HEADROOM``: device memory a KV growth must leave free (``size_bytes=0``: off)."""


@dataclass(frozen=True)
class ReserveBounds:
    min_pages: int
    max_pages: int


class _Bad:
    """Stands in a :class:`Settings` field whose value was refused; reading the field raises."""

    def __init__(self, error: ConfigError) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<refused: {self.error}>"


@dataclass(frozen=True, repr=False)
class Settings:
    """The parsed environment. Reading a field whose variable holds a bad value raises its ConfigError."""

    shm_dir: Path
    page_size_bytes: int
    reserve: ReserveBounds
    max_cached_tokens: int
    max_cached_blocks: int | None  # as set; None when unset
    host_capacity_bytes: int
    device_budget: DeviceBudget | None  # None: the driver's out-of-memory is the budget
    device_headroom: DeviceHeadroom  # KVCACHED_DEVICE_HEADROOM; 0 bytes: off
    min_bytes: int  # KVCACHED_MIN; 0: none
    priority: int
    policy: str
    idle_return_s: float | None  # None: never
    ipc_name: str | None
    cuda_layout: str
    cuda_pool_pages: int
    cuda_async_unmap: bool
    cuda_unmap_delay_s: float
    cuda_native: str  # auto / on / off
    fastpath: str  # auto / on / off
    tp_strategy: str
    tp_timeout_s: float
    kvctl_debug: bool
    enable_kvcached: bool
    endpoint: str | None  # KVCACHED_ENDPOINT; None: unset
    route_api_key: str | None  # KVCTL_ROUTE_API_KEY; None: unset (never shown by repr)
    given: frozenset[str] = field(default=frozenset())  # the variables set to a non-empty value

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if isinstance(value, _Bad):
            raise value.error
        return value

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={'<hidden>' if f.name == 'route_api_key' else repr(object.__getattribute__(self, f.name))}"
                          for f in fields(self))
        return f"Settings({shown})"

    def mode(self, name: str) -> str:
        """The auto/on/off setting of a native part, by its variable's name."""
        return {"KVCACHED_FASTPATH": self.fastpath, "KVCACHED_CUDA_NATIVE": self.cuda_native}[name]

    def cached_blocks(self, block_tokens: int) -> int | None:
        """The prefix-cache budget in blocks of ``block_tokens`` tokens; None: unlimited, 0: the cache is off."""
        blocks = self.max_cached_blocks
        if blocks is not None:
            return None if blocks < 0 else blocks
        tokens = self.max_cached_tokens
        if tokens < 0:
            return None
        if tokens == 0:
            return 0
        return max(1, tokens // max(1, block_tokens))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        raw = {v.name: env.get(v.name) for v in VARIABLES}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "given":
                continue
            try:
                values[f.name] = _PARSERS[f.name](raw, values)
            except ConfigError as exc:
                values[f.name] = _Bad(exc)
        given = frozenset(name for name, value in raw.items() if value)
        return cls(**values, given=given)


_cache: tuple[tuple[object, ...], Settings] | None = None
_ENCODED_NAMES = tuple(os.fsencode(v.name) for v in VARIABLES)


def settings() -> Settings:
    """The settings of the current environment: parsed once, again only after a variable changed."""
    global _cache
    data = getattr(os.environ, "_data", None)  # the encoded mapping behind os.environ: no value is decoded
    if isinstance(data, dict) and os.name == "posix":
        key = tuple(map(data.get, _ENCODED_NAMES))
    else:
        key = tuple(os.environ.get(v.name) for v in VARIABLES)
    cached = _cache
    if cached is not None and cached[0] == key:
        return cached[1]
    parsed = Settings.from_env()
    _cache = (key, parsed)
    return parsed


# -- parsers: raw values by name, and the fields parsed so far ------------------------------------

Raw = Mapping[str, "str | None"]


def _value(raw: Raw, name: str) -> str:
    """The stripped value, or the declared default when it is unset or blank."""
    return (raw[name] or "").strip() or (BY_NAME[name].default or "")


def _int(raw: Raw, name: str) -> int:
    value = raw[name]
    if value is None or not value.strip():
        value = BY_NAME[name].default or ""
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={raw[name]!r} is not an integer") from None


def _float(raw: Raw, name: str, what: str = "a number") -> float:
    value = _value(raw, name)
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not {what}") from None


def _choice(raw: Raw, name: str, choices: tuple[str, ...], message: str, *, lower: bool = False) -> str:
    value = _value(raw, name).lower() if lower else _value(raw, name)
    if value not in choices:
        raise ConfigError(message.format(value=value, choices=", ".join(choices)))
    return value


def _page_size(raw: Raw, done: dict[str, Any]) -> int:
    mb = _int(raw, "KVCACHED_PAGE_SIZE_MB")
    if mb <= 0 or (mb * MiB) % PAGE_GRAIN:
        raise ConfigError(f"KVCACHED_PAGE_SIZE_MB={mb} must be a positive multiple of {PAGE_GRAIN // MiB}")
    return mb * MiB


def _reserve(raw: Raw, done: dict[str, Any]) -> ReserveBounds:
    lo = _int(raw, "KVCACHED_MIN_RESERVED_PAGES")
    hi = _int(raw, "KVCACHED_MAX_RESERVED_PAGES")
    if lo < 0 or hi < lo:
        raise ConfigError(
            f"reserve bounds need 0 <= KVCACHED_MIN_RESERVED_PAGES ({lo}) <= KVCACHED_MAX_RESERVED_PAGES ({hi})"
        )
    return ReserveBounds(lo, hi)


def _cached_blocks(raw: Raw, done: dict[str, Any]) -> int | None:
    if not (raw["KVCACHED_MAX_CACHED_BLOCKS"] or "").strip():
        return None
    return _int(raw, "KVCACHED_MAX_CACHED_BLOCKS")


def _host_capacity(raw: Raw, done: dict[str, Any]) -> int:
    value = raw["KVCACHED_HOST_CAPACITY"]
    if value:
        try:
            parsed = parse_size(value, percent_of=total_ram_bytes())
        except SizeError as exc:
            raise ConfigError(f"KVCACHED_HOST_CAPACITY: {exc}") from None
        assert parsed is not None
        return parsed
    return int(total_ram_bytes() * HOST_CAPACITY_FRACTION)


def _device_budget(raw: Raw, done: dict[str, Any]) -> DeviceBudget | None:
    value = (raw["KVCACHED_DEVICE_BUDGET"] or "").strip()
    if not value or value.lower() == "none":
        return None
    percent = value.endswith("%")
    try:
        parsed = parse_size(value, percent_of=100 * 2**20)  # checks a percentage's range too
    except SizeError as exc:
        raise ConfigError(f"KVCACHED_DEVICE_BUDGET: {exc}") from None
    if percent:
        return DeviceBudget(percent=float(value[:-1]))
    if not parsed:
        raise ConfigError(f"KVCACHED_DEVICE_BUDGET={value!r} must be above 0 (unset it for no budget)")
    return DeviceBudget(size_bytes=parsed)


def _device_headroom(raw: Raw, done: dict[str, Any]) -> DeviceHeadroom:
    """A percentage below 100, a fraction below 1 (as a GPU-utilization setting's complement), or a size; 0 is off."""
    name = "KVCACHED_DEVICE_HEADROOM"
    value = _value(raw, name)
    if value.lower() in _HEADROOM_OFF:  # not parse_size's "unlimited": no headroom is not an unlimited one
        return DeviceHeadroom(size_bytes=0)
    if value.endswith("%") or _FRACTION_RE.match(value):
        try:
            share = float(value[:-1]) / 100 if value.endswith("%") else float(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a percentage (try 5%)") from None
        if share >= 1 and not value.endswith("%"):
            raise ConfigError(f"{name}={value!r}: a bare number is a fraction of the device, below 1 "
                              f"({value}GiB for a size, {value}% for a percentage)")
        if not 0 <= share < 1:
            raise ConfigError(f"{name}={value!r} must be from 0 (off) to below 100% of the device")
        return DeviceHeadroom(size_bytes=0) if share == 0 else DeviceHeadroom(percent=share * 100)
    try:
        parsed = parse_size(value)
    except SizeError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    assert parsed is not None
    return DeviceHeadroom(size_bytes=parsed)


def _min_bytes(raw: Raw, done: dict[str, Any]) -> int:
    value = (raw["KVCACHED_MIN"] or "").strip()
    if not value:
        return 0
    try:
        parsed = parse_size(value, allow_none=True)
    except SizeError as exc:
        raise ConfigError(f"KVCACHED_MIN: {exc}") from None
    return parsed or 0


def _priority(raw: Raw, done: dict[str, Any]) -> int:
    value = _int(raw, "KVCACHED_PRIORITY")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ConfigError(f"KVCACHED_PRIORITY={value} must be between {PRIORITY_MIN} and {PRIORITY_MAX}")
    return value


def _policy(raw: Raw, done: dict[str, Any]) -> str:
    value = raw["KVCACHED_POLICY"] or BY_NAME["KVCACHED_POLICY"].default or ""
    if value not in POLICIES:
        raise ConfigError(f"KVCACHED_POLICY: unknown placement policy {value!r}: use one of {', '.join(POLICIES)}")
    return value


def _idle(raw: Raw, done: dict[str, Any]) -> float | None:
    value = _float(raw, "KVCACHED_IDLE_RETURN_S")
    return None if value < 0 else value


def _pool_pages(raw: Raw, done: dict[str, Any]) -> int:
    name = "KVCACHED_CUDA_POOL_PAGES"
    value = (raw[name] or "").strip()
    if not value:
        reserve = done["reserve"]
        if isinstance(reserve, _Bad):
            raise reserve.error
        return int(reserve.max_pages)
    try:
        pages = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if pages < 0:
        raise ConfigError(f"{name}={pages} cannot be negative")
    return pages


def _async_unmap(raw: Raw, done: dict[str, Any]) -> bool:
    name = "KVCACHED_CUDA_ASYNC_UNMAP"
    value = _value(raw, name).lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{name}={value!r} is not a boolean (1 or 0)")
    return value in _TRUE


def _unmap_delay(raw: Raw, done: dict[str, Any]) -> float:
    name = "KVCACHED_CUDA_UNMAP_DELAY_MS"
    value = _float(raw, name, "a number of milliseconds")
    if not 0 <= value <= 60_000:
        raise ConfigError(f"{name}={_value(raw, name)} must be between 0 and 60000 milliseconds")
    return value / 1000


def _tristate(name: str) -> Callable[[Raw, dict[str, Any]], str]:
    def parse(raw: Raw, done: dict[str, Any]) -> str:
        value = _value(raw, name).lower()
        if value not in _TRISTATE:
            raise ConfigError(f"{name}={value!r} must be auto, 1 or 0")
        return _TRISTATE[value]
    return parse


def _tp_timeout(raw: Raw, done: dict[str, Any]) -> float:
    value = _float(raw, "KVCACHED_TP_TIMEOUT_S")
    if value <= 0:
        raise ConfigError(f"KVCACHED_TP_TIMEOUT_S={value!r} must be positive")
    return value


def _endpoint(raw: Raw, done: dict[str, Any]) -> str | None:
    value = (raw["KVCACHED_ENDPOINT"] or "").strip()
    if not value:
        return None
    problem = endpoint_problem(value)
    if problem is not None:
        raise ConfigError(f"KVCACHED_ENDPOINT: {problem}")
    return value


def _enable(raw: Raw, done: dict[str, Any]) -> bool:
    value = (raw["ENABLE_KVCACHED"] or "").strip().lower()
    if value in _TRUE:
        return True
    if value in ("",) + _FALSE:
        return False
    raise ConfigError(f"ENABLE_KVCACHED={value!r}: use true or false")


_PARSERS: dict[str, Callable[[Raw, dict[str, Any]], Any]] = {
    "shm_dir": lambda raw, done: Path(raw["KVCACHED_SHM_DIR"] or BY_NAME["KVCACHED_SHM_DIR"].default or ""),
    "page_size_bytes": _page_size,
    "reserve": _reserve,
    "max_cached_tokens": lambda raw, done: _int(raw, "KVCACHED_MAX_CACHED_TOKENS"),
    "max_cached_blocks": _cached_blocks,
    "host_capacity_bytes": _host_capacity,
    "device_budget": _device_budget,
    "device_headroom": _device_headroom,
    "min_bytes": _min_bytes,
    "priority": _priority,
    "policy": _policy,
    "idle_return_s": _idle,
    "ipc_name": lambda raw, done: raw["KVCACHED_IPC_NAME"] or None,
    "cuda_layout": lambda raw, done: _choice(
        raw, "KVCACHED_CUDA_LAYOUT", CUDA_LAYOUTS, "KVCACHED_CUDA_LAYOUT={value!r} is not a layout: choose one of {choices}",
        lower=True),
    "cuda_pool_pages": _pool_pages,
    "cuda_async_unmap": _async_unmap,
    "cuda_unmap_delay_s": _unmap_delay,
    "cuda_native": _tristate("KVCACHED_CUDA_NATIVE"),
    "fastpath": _tristate("KVCACHED_FASTPATH"),
    "tp_strategy": lambda raw, done: _choice(
        raw, "KVCACHED_TP_STRATEGY", TP_STRATEGIES, "KVCACHED_TP_STRATEGY={value!r}: choose one of {choices}"),
    "tp_timeout_s": _tp_timeout,
    "kvctl_debug": lambda raw, done: bool(raw["KVCTL_DEBUG"]),
    "enable_kvcached": _enable,
    "endpoint": _endpoint,
    "route_api_key": lambda raw, done: raw["KVCTL_ROUTE_API_KEY"] or None,
}


def markdown_table() -> str:
    """The variables as docs/environment.md lists them."""
    rows = ["| variable | default | type | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default_text} | {v.type} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())


def shm_dir_problem(directory: Path | None = None, *, writable: bool = False) -> str | None:
    """Why the segment directory (``directory``, else ``KVCACHED_SHM_DIR``'s) cannot be used, as one line; None
    when it can. A missing directory would otherwise read as an empty fleet; ``writable`` also asks that
    allocators could create segments there."""
    path = directory or settings().shm_dir
    named = f"KVCACHED_SHM_DIR={path}" if directory is None and "KVCACHED_SHM_DIR" in settings().given else str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"segment directory {named} does not exist"
    except OSError as exc:
        return f"segment directory {named}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"segment directory {named} is not a directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"segment directory {named} cannot be read (permission denied)"
    if writable and not os.access(path, os.W_OK | os.X_OK):
        return f"segment directory {named} is not writable: allocators cannot create segments there"
    return None
