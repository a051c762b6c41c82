"""Roleplaying deception probe: score every sample with a linear probe on the residual stream.

    inspect eval tasks/roleplaying_probe.py --model vllm-lens/smollm2-135m-instruct
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T probe=probes/NAME.joblib
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T dataset=path/to/apollo/dataset.yaml
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T mode=on_policy -T grader=openai/gpt-4o-mini
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T probes=ip-lr,ip-dom,rp-lr -T probe_set=probes/MODEL__probe-set.json

See tasks/README.md. Metrics: AUROC, recall at the probe's 1%-FPR threshold, mean score per class.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.evals.roleplaying import roleplaying_task

PROBE_DIR = Path(os.environ.get("LENS_EVALS_PROBE_DIR", Path(__file__).resolve().parents[1] / "probes"))


@task
def roleplaying_probe(
    probe: str | None = None,
    mode: str = "off_policy",
    dataset: str | None = None,
    grader: str | None = None,
    tokenizer: str | None = None,
    max_tokens: int = 48,
    on_worker: bool = True,
    probes: str | None = None,
    probe_set: str | None = None,
) -> Task:
    """``probe`` defaults to the default model's Instructed-Pairs probe (trained if missing).
    ``probes=ip-lr,ip-dom,rp-lr`` (any of them) reads those probes of ``probe_set`` (default: the
    default model's, trained if missing) in one engine pass, off-policy; metrics per probe."""
    if probes is not None or probe_set is not None:
        from lens_evals.evals.multi_probe import roleplaying_probes_task
        from lens_evals.probing.multi import ensure_probe_set
        from lens_evals.probing.train import DEFAULT_MODEL

        os.environ.setdefault("LENS_EVALS_PROBE_DIR", str(PROBE_DIR))
        return roleplaying_probes_task(probe_set or ensure_probe_set(DEFAULT_MODEL), probes=probes, dataset=dataset,
                                       tokenizer=tokenizer)
    if probe is None:
        from lens_evals.probing.train import ensure_default_probe

        os.environ.setdefault("LENS_EVALS_PROBE_DIR", str(PROBE_DIR))
        probe = str(ensure_default_probe())
    return roleplaying_task(probe, mode=mode, dataset=dataset, grader=grader, tokenizer=tokenizer,  # type: ignore[arg-type]
                            max_tokens=max_tokens, on_worker=on_worker)
