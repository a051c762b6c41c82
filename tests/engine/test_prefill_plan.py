"""The prefill fast paths of the step (issue #21), without an engine: several capture layers
gathered straight into one block that the store keeps as it is, and one steering vector shared
by every request of a step added as a broadcast row. Each result is checked against the stream
computed here by hand."""

from __future__ import annotations

import torch

from lens_evals.engine.compat.worker import BatchLayout
from lens_evals.engine.worker.planners import build_plan
from lens_evals.engine.worker.requests import CACHED_STEERING_BYTES, WorkerLensRequest, WorkerSteering, _decode_steering, steering_digest
from lens_evals.engine.worker.step_stores import StepStores
from lens_evals.engine.worker.taps import StepContext, _apply_steering, read_step
from lens_evals.request.spec import SteeringVector
from tests.tolerance import assert_stream_close

CPU = torch.device("cpu")
HIDDEN = 16
LAYOUT = BatchLayout(["a", "b", "c"], [5, 3, 7], [0, 0, 0])  # a prefill step: three whole prompts


def _plan(requests: dict[str, WorkerLensRequest]):
    plan = build_plan(LAYOUT, dict(requests), CPU, torch.float32, True, {0, 1, 2, 3})
    assert plan is not None
    return plan


def _steered(vector: torch.Tensor, scale: float, norm_match: bool = False, digest: bool = True) -> WorkerSteering:
    """Each request its own copy of ``vector`` at layer 1, named by its content as the worker
    names a decoded vector (``digest``)."""
    named = steering_digest(vector.numpy()[None], [1], None, norm_match) if digest else None
    return WorkerSteering({1: vector.clone()}, None, scale, norm_match, named)


def test_capture_layers_are_gathered_into_one_block_kept_by_the_store() -> None:
    torch.manual_seed(0)
    requests = {r: WorkerLensRequest(key=f"k{r}", capture_layers=[0, 2]) for r in ("a", "b", "c")}
    plan = _plan(requests)
    step = StepContext(plan, lambda call, layer: None, lambda key, message: None, lambda key: False)  # type: ignore[arg-type, return-value]
    streams = {}
    for layer in (0, 2):
        hidden, residual = torch.randn(15, HIDDEN), torch.randn(15, HIDDEN)
        streams[layer] = hidden + residual
        read_step(step, layer, hidden, residual)
    assert step.capture_block is not None and step.capture_block.shape == (2, 15, HIDDEN)
    assert torch.equal(step.capture_block, torch.stack([streams[0], streams[2]]))
    stores = StepStores(max_held_bytes=2**30)
    stores.store(plan, step.captures, step.scores, lambda key: True, step.capture_block)
    (piece,) = stores.captures.by_key["kb"]
    assert piece.buffer.data.data_ptr() == step.capture_block.data_ptr()  # no second copy
    assert torch.equal(torch.from_numpy(piece.rows()), torch.stack([streams[0][5:8], streams[2][5:8]]))


def test_one_vector_for_every_request_is_added_as_one_broadcast_row() -> None:
    torch.manual_seed(1)
    vector = torch.randn(1, HIDDEN)
    requests = {r: WorkerLensRequest(key=f"k{r}", capture_layers=[], steering=[_steered(vector, 0.5)]) for r in ("a", "b", "c")}
    steer = _plan(requests).steer[1]
    assert steer.vectors.shape == (1, HIDDEN) and steer.span == (0, 15)
    hidden = torch.randn(15, HIDDEN)
    expected = hidden + 0.5 * vector
    _apply_steering(hidden, None, steer)
    assert torch.equal(hidden, expected)


def test_shared_norm_matched_vector_scales_each_row_by_its_own_norm() -> None:
    torch.manual_seed(2)
    unit = torch.nn.functional.normalize(torch.randn(1, HIDDEN), dim=-1)
    requests = {
        r: WorkerLensRequest(key=f"k{r}", capture_layers=[], steering=[_steered(unit, 0.25, norm_match=True)]) for r in ("a", "b", "c")
    }
    steer = _plan(requests).steer[1]
    assert steer.vectors.shape == (1, HIDDEN) and steer.any_norm_match
    hidden, residual = torch.randn(15, HIDDEN), torch.randn(15, HIDDEN)
    norms = (hidden + residual).norm(dim=-1, keepdim=True)
    expected = hidden + 0.25 * norms * unit
    _apply_steering(hidden, residual, steer)
    assert_stream_close(hidden, expected, "shared norm-matched steering")


def test_different_vectors_or_scales_keep_one_row_per_token() -> None:
    torch.manual_seed(3)
    vector, other = torch.randn(1, HIDDEN), torch.randn(1, HIDDEN)
    for steering_c in (_steered(other, 0.5), _steered(vector, 2.0)):
        requests = {
            "a": WorkerLensRequest(key="ka", capture_layers=[], steering=[_steered(vector, 0.5)]),
            "b": WorkerLensRequest(key="kb", capture_layers=[], steering=[_steered(vector, 0.5)]),
            "c": WorkerLensRequest(key="kc", capture_layers=[], steering=[steering_c]),
        }
        steer = _plan(requests).steer[1]
        assert steer.vectors.shape == (15, HIDDEN)
        hidden = torch.randn(15, HIDDEN)
        expected = hidden.clone()
        expected[:8] += 0.5 * vector
        expected[8:] += steering_c.scale * steering_c.vectors[1]
        _apply_steering(hidden, None, steer)
        assert torch.equal(hidden, expected)


def test_equal_copies_without_a_digest_keep_one_row_per_token() -> None:
    """Copies the planner cannot name (no digest) are never compared on the device: each request
    keeps its own rows, and the sum is the same."""
    torch.manual_seed(4)
    vector = torch.randn(1, HIDDEN)
    requests = {
        r: WorkerLensRequest(key=f"k{r}", capture_layers=[], steering=[_steered(vector, 0.5, digest=False)]) for r in ("a", "b", "c")
    }
    steer = _plan(requests).steer[1]
    assert steer.vectors.shape == (15, HIDDEN)
    hidden = torch.randn(15, HIDDEN)
    expected = hidden + 0.5 * vector
    _apply_steering(hidden, None, steer)
    assert torch.equal(hidden, expected)


def test_requests_sending_one_vector_share_its_device_tensor() -> None:
    """The worker decodes a vector once per content: requests that send the same vector share
    the tensor (and its digest); another vector, norm matching or position gets its own."""
    array = torch.randn(1, HIDDEN).numpy()
    one, two = (
        _decode_steering(SteeringVector(activations=array.copy(), layer_indices=[1], scale=s), CPU, torch.float32) for s in (0.5, 2.0)
    )
    assert one.vectors[1].data_ptr() == two.vectors[1].data_ptr() and one.digest == two.digest
    others = [
        SteeringVector(activations=array + 1, layer_indices=[1]),
        SteeringVector(activations=array.copy(), layer_indices=[2]),
        SteeringVector(activations=array.copy(), layer_indices=[1], norm_match=True),
        SteeringVector(activations=array.copy(), layer_indices=[1], position_indices=[3]),
    ]
    digests = {_decode_steering(vec, CPU, torch.float32).digest for vec in others}
    assert len(digests) == 4 and one.digest not in digests
    # a vector too large to keep on the device for later requests: decoded per request, one digest
    large = torch.randn(1, CACHED_STEERING_BYTES // 4 + 1).numpy()
    big = [_decode_steering(SteeringVector(activations=large.copy(), layer_indices=[1]), CPU, torch.float32) for _ in range(2)]
    assert big[0].vectors[1].data_ptr() != big[1].vectors[1].data_ptr() and big[0].digest == big[1].digest
