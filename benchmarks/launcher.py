"""Launch each system in its own process, watch its process tree's memory, collect its result."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from benchmarks.config import BenchConfig
from benchmarks.measure import Result, write_result
from benchmarks.prefill import MANY_LAYERS
from benchmarks.systems import ALL_SYSTEMS, BASELINE, System
from lens_evals import settings

logger = logging.getLogger("benchmarks")
POLL_SECONDS = 0.2
KV_CACHE_GIB = "2"


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def child_env() -> dict[str, str]:
    """This environment, with this checkout of lens_evals first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH", "")) if p)
    return env


def system_env(system: System, cfg: BenchConfig) -> dict[str, str]:
    """The child's environment: the plugin off for pure vLLM, on (forcing eager) for ours."""
    env = child_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.engine == "inprocess" else "1"
    # The plugin plans steps from vLLM's V1 model runner (vLLM 0.26 on GPU would pick V2 for
    # Llama): every vLLM system runs on V1, so pure vLLM and ours are the same engine.
    if system.on_vllm or system.kind == "nnsight-vllm":
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    workers = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if workers > 1 and cfg.device == "cpu" and system.on_vllm:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core) for core in range(workers)))
    if system.lens is None:  # pure vLLM and the other tools run without our plugin
        env[settings.DISABLE.name] = "1"
    else:
        env.pop(settings.DISABLE.name, None)
    if not system.copy_overlap:
        env[settings.COPY_OVERLAP.name] = "0"
    held_layers = {"capture-all": cfg.num_layers, "capture-8": MANY_LAYERS}.get(system.lens or "", 0)
    if system.lens == "mixed" and cfg.workload == "prefill":
        held_layers = MANY_LAYERS  # its capture-8 rounds
    if held_layers:
        # Every request's rows of every captured layer are held until the offline call returns.
        positions = cfg.prompt_tokens + len(cfg.prompts) * cfg.max_tokens
        need_gib = positions * min(held_layers, cfg.num_layers) * cfg.hidden_size * 4 / 2**30
        env[settings.MAX_HELD_CAPTURE_GIB.name] = str(max(8.0, round(need_gib * 1.5, 1)))
    return env


def _tree_rss(proc: psutil.Process) -> int:
    """Summed RSS of a process and its descendants (shared pages counted once per process)."""
    total = 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for member in members:
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class DeviceMemory:
    """Device memory in use on GPU 0 (NVML), sampled with the host memory: a system's peak is the
    most seen while it ran less what was in use before it started (one system runs at a time)."""

    def __init__(self, device: str) -> None:
        self.handle: Any = None
        if device != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # noqa: BLE001 - the row then says "-" for device memory
            logger.warning("device memory not sampled: %s", exc)
        self.before = self.used()
        self.peak = self.before

    def used(self) -> int:
        if self.handle is None:
            return 0
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def sample(self) -> None:
        if self.handle is not None:
            self.peak = max(self.peak, self.used())

    def peak_bytes(self) -> int | None:
        return None if self.handle is None else self.peak - self.before


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        return


def launch(system: System, cfg: BenchConfig, cfg_path: Path, out_dir: Path) -> Result:
    """Run one system's process to the end; its result JSON plus the peak host memory seen."""
    result_path = out_dir / "systems" / f"{system.name}.json"
    result_path.unlink(missing_ok=True)
    log_path = out_dir / "logs" / f"{system.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.child", str(cfg_path), system.name, str(result_path)]
    started = time.perf_counter()
    peak = 0
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=system_env(system, cfg), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        watched = psutil.Process(proc.pid)
        device = DeviceMemory(cfg.device)
        try:
            while proc.poll() is None:
                peak = max(peak, _tree_rss(watched))
                device.sample()
                if time.perf_counter() - started > cfg.timeout_s:
                    timed_out = True
                    _stop_group(proc)
                    break
                time.sleep(POLL_SECONDS)
        finally:
            if proc.poll() is None:
                _stop_group(proc)
    wall = time.perf_counter() - started
    result: Result
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        reason = f"timed out after {cfg.timeout_s:.0f} s" if timed_out else f"exited {proc.returncode} without a result"
        result = {"system": system.name, "status": "failed", "reason": f"{reason}: {' | '.join(tail)}"[:800]}
    result.update(
        peak_rss_bytes=max(peak, int(result.get("child_max_rss_bytes", 0))),
        process_seconds=wall,
        log=str(log_path),
        peak_device_bytes=device.peak_bytes(),
    )
    write_result(result_path, result)  # with the memory seen from outside, so --resume keeps it
    return result


def _same_work(saved: Path, cfg: BenchConfig) -> bool:
    if not saved.exists():
        return False
    before = json.loads(saved.read_text())
    now = json.loads(json.dumps(asdict(cfg)))
    return all(before.get(k) == v for k, v in now.items() if k != "timeout_s")


def run_systems(systems: list[System], cfg: BenchConfig, out_dir: Path, resume: bool = False) -> list[Result]:
    """Run each system; with ``resume``, keep results already in ``out_dir`` from a run of the same
    work (same config) instead of rerunning them, and report those of other systems too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "config.json"
    kept: dict[str, Result] = {}
    if resume and _same_work(cfg_path, cfg):
        for path in sorted((out_dir / "systems").glob("*.json")):
            result = json.loads(path.read_text())
            if result.get("system") in ALL_SYSTEMS and "peak_rss_bytes" in result:
                kept[result["system"]] = result
    elif resume:
        print("[bench] --resume: no earlier run of the same work here; running everything asked", flush=True)
    cfg.save(cfg_path)
    results = dict(kept)
    # A SIGTERM to this process unwinds through launch(), which stops the system's process group.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _run_each(systems, kept, results, cfg, cfg_path, out_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)
    order = list(ALL_SYSTEMS)
    return [results[name] for name in sorted(results, key=order.index)]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _run_each(
    systems: list[System], kept: dict[str, Result], results: dict[str, Result], cfg: BenchConfig, cfg_path: Path, out_dir: Path
) -> None:
    for system in systems:
        if system.name in kept and kept[system.name]["status"] == "ok":
            print(f"[bench] {system.name}: kept from the earlier run", flush=True)
            continue
        print(f"[bench] {system.name}: {system.label} ...", flush=True)
        result = launch(system, cfg, cfg_path, out_dir)
        detail = f"{result['seconds']:.2f} s" if result["status"] == "ok" else result.get("reason", "")
        print(f"[bench] {system.name}: {result['status']} {detail}", flush=True)
        if system.name == BASELINE and result["status"] != "ok":
            logger.warning("the baseline %s did not run: ratios will be missing", BASELINE)
        results[system.name] = result
