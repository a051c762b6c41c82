"""The plugin's own host time per feature from a ``lens-mixed`` run made with
``LENS_EVALS_TIMING=1``: ``python -m benchmarks.phases OUT_DIR`` (the bench's ``--out``).

Each fetch logs its phases (``lens_evals timing (worker)`` then ``(frontend)``); plain rounds
fetch nothing, so the logged fetches follow the non-plain features in the order they ran (one
warm-up each, then the rotated rounds). Prints the median over rounds of each phase in ms, and
our total (the phases that do not nest: the forward itself and the round trip around the
worker's phases are left out, and so are the early writes on the worker's writer thread, which
run beside the steps) as a share of the median plain round."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks.config import BenchConfig
from benchmarks.interleaved import features_of, rotated
from benchmarks.systems import ALL_SYSTEMS

_LINE = re.compile(r"lens_evals timing \((worker|frontend)\): (.*)")
_PART = re.compile(r"(.*) ([0-9.]+) ms / (\d+)$")
NESTED = ("forward with taps (queued)", "forward (queued)", "fetch: worker round trip", "fetch: wait for early writes")
OVERLAPPED = ("early: write rows",)  # on the worker's writer thread, beside the steps (``early_write``)


def fetches(log: Path) -> list[dict[str, float]]:
    """Each fetch's phases (worker and frontend lines joined), in order."""
    out: list[dict[str, float]] = []
    current: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        found = _LINE.search(line)  # worker lines carry vLLM's "(EngineCore pid=N) " prefix
        if not found:
            continue
        for part in found.group(2).split(", "):
            named = _PART.match(part)
            if named:
                current[named.group(1)] = float(named.group(2))
        if found.group(1) == "frontend":
            out.append(current)
            current = {}
    return out


def per_feature(out_dir: Path, system: str = "lens-mixed") -> dict[str, dict[str, float]]:
    cfg = BenchConfig.load(out_dir / "config.json")
    features = features_of(ALL_SYSTEMS[system], cfg)
    result = json.loads((out_dir / "systems" / f"{system}.json").read_text())
    rounds = len(result["interleaved"]["times"]["plain"])
    order = [f for f in features if f != "plain"]  # the warm-up
    for index in range(rounds):
        order += [f for f in rotated(features, index) if f != "plain"]
    logged = fetches(out_dir / "logs" / f"{system}.log")
    if len(logged) != len(order):
        raise ValueError(f"{len(logged)} timed fetches in the log, expected {len(order)} (was LENS_EVALS_TIMING=1 set?)")
    warm = len(features) - 1
    plain_ms = 1e3 * statistics.median(result["interleaved"]["times"]["plain"])
    table: dict[str, dict[str, float]] = {}
    for feature in features[1:]:
        runs = [phases for name, phases in zip(order[warm:], logged[warm:]) if name == feature]
        names = sorted({name for phases in runs for name in phases})
        medians = {name: statistics.median(p.get(name, 0.0) for p in runs) for name in names}
        own = sum(v for name, v in medians.items() if name not in NESTED + OVERLAPPED)
        table[feature] = {**medians, "ours (not nested)": own, "share of plain round": own / plain_ms}
    return table


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for feature, phases in per_feature(Path(args[0])).items():
        cells = ", ".join(f"{name} {value:.1f}" for name, value in phases.items() if name != "share of plain round")
        print(f"{feature}: {cells} ms; {phases['share of plain round']:.1%} of the median plain round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
