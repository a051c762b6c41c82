"""Petri audits with an auditor that reads the target's activations: ``lens_evals/petri_audit``."""

from lens_evals.evals.petri_audit.petri_audit import build_inspectors, petri_audit

__all__ = ["build_inspectors", "petri_audit"]
