"""How weak is the on-policy grader? It grades the labelled off-policy Roleplaying completions
(honest and deceptive, written by us) with the same prompt and parsing as the on-policy task
(``lens_evals.evals.roleplaying.grader_label``), and we count how often it agrees with the label.

    python scripts/grader_check.py --model vllm-lens/MODEL --out grader_check.json [--limit N]

With ``VLLM_LENS_BASE_URL`` set, the provider uses that running server (scripts/gpu_science.sh)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from inspect_ai.model import get_model

from lens_evals.evals.roleplaying import grader_label, roleplaying_samples
from lens_evals.probing.datasets import load_roleplaying


async def grade_all(model_name: str, limit: int | None, concurrency: int) -> dict:
    samples = roleplaying_samples(load_roleplaying(None), "off_policy")[:limit]
    label = grader_label(get_model(model_name))  # grader_label caps the verdict itself
    gate = asyncio.Semaphore(concurrency)

    async def one(sample) -> tuple[int, int | None, str]:
        state = SimpleNamespace(messages=[sample.input[-1]], metadata=sample.metadata)
        async with gate:
            verdict, explanation = await label(state)
        return int(sample.metadata["label"]), verdict, explanation

    graded = await asyncio.gather(*(one(s) for s in samples))
    counts = Counter((truth, verdict) for truth, verdict, _ in graded)
    decided = [(t, v) for t, v, _ in graded if v is not None]
    return {
        "grader": model_name,
        "n": len(graded),
        "accuracy": sum(t == v for t, v, _ in graded) / len(graded),
        "accuracy_when_decided": sum(t == v for t, v in decided) / len(decided) if decided else None,
        "ambiguous_share": 1 - len(decided) / len(graded),
        "confusion": {
            f"{'deceptive' if t else 'honest'} -> {'ambiguous' if v is None else ('deceptive' if v else 'honest')}": n
            for (t, v), n in sorted(counts.items(), key=str)
        },
        "examples": [{"label": t, "verdict": v, "explanation": e} for t, v, e in graded[:6]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the grader, e.g. vllm-lens/qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    start = time.perf_counter()
    result = asyncio.run(grade_all(args.model, args.limit, args.concurrency))
    result["seconds"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=2))


if __name__ == "__main__":
    main()
