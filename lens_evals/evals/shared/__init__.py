"""What several evals use: the capture and steer solvers (``lens_solvers``), the probe solver and
its scorer (``probe_solver``, ``probe_scorer``, ``probe_reading``), the final-turn readers that run
in a client-only install (``target_turn``, ``turn_probe``), and the default probe files
(``default_probes``)."""
