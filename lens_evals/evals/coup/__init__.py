"""Coup probes (Roger 2023): ``lens_evals/coup_probe``."""

from lens_evals.evals.coup.coup import coup_probe, coup_task, read_trajectories

__all__ = ["coup_probe", "coup_task", "read_trajectories"]
