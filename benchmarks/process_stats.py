"""Per-process statistics on Linux for the benchmarks that drive other processes (a server, its
engine core): peak RSS since a reset, CPU seconds, the engine core's pid."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def reset_peak_rss(pid: int | str = "self") -> None:
    """Reset a process's VmHWM (Linux: ``clear_refs`` 5), so each phase reports its own peak."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError as exc:
        print(f"peak RSS of {pid} not resettable ({exc}); later phases report the process-wide peak")


def peak_rss_gib(pid: int | str = "self") -> float:
    """A process's peak RSS since its last reset (VmHWM); for this process ru_maxrss where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError as exc:
        if pid != "self":
            print(f"peak RSS of {pid} unreadable ({exc})")
            return float("nan")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def cpu_seconds(pid: int | str = "self") -> float:
    """A process's user + system CPU seconds so far (Linux ``/proc/PID/stat``); NaN where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError as exc:
        print(f"CPU time of {pid} unreadable ({exc})")
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def engine_core_pid(server_pid: int) -> int | None:
    """The API server's child process running vLLM's engine core (any of its threads may have
    started it), if it runs in one."""
    for children in Path(f"/proc/{server_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            if "EngineCore" in Path(f"/proc/{pid}/comm").read_text() or "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text():
                return int(pid)
    return None
