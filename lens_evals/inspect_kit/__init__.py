"""The Inspect AI layer that the evals, the integrations and the report build on: the model API
``vllm-lens/<model>`` (``provider/``), the capture and steer solvers (``lens_solvers``), the probe
solver and its scorer (``probe_solver``, ``probe_scorer``, ``probe_reading``), the activation
oracle's solver (``oracle_solver``), the final-turn readers that run in a client-only install
(``target_turn``, ``turn_probe``), and the default probe files (``default_probes``). Named so that
it cannot shadow Inspect's own ``inspect_ai`` nor the standard library's ``inspect``."""
