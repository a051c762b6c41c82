"""Roleplaying deception probes: ``lens_evals/roleplaying_probe`` (one probe, or several in one pass)."""

from lens_evals.evals.roleplaying.multi_probe import roleplaying_probes_task
from lens_evals.evals.roleplaying.roleplaying import grader_label, roleplaying_probe, roleplaying_task
from lens_evals.evals.roleplaying.scenarios import roleplaying_samples

__all__ = ["grader_label", "roleplaying_probe", "roleplaying_probes_task", "roleplaying_samples", "roleplaying_task"]
