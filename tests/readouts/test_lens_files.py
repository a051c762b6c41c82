"""Affine-lens files: written and read back bit for bit; every malformed file refused with an
error naming the file and the problem; nothing unpickled."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from lens_evals.readouts.lens_files import AffineLensWeights, LensFileError, load_affine_lens, save_affine_lens


def lens(d: int = 8, layers: tuple[int, ...] = (0, 3), seed: int = 0) -> AffineLensWeights:
    rng = np.random.default_rng(seed)
    weights = {i: rng.normal(size=(d, d)).astype(np.float32) for i in layers}
    biases = {i: rng.normal(size=d).astype(np.float32) for i in layers}
    return AffineLensWeights("tuned", weights, biases, {"steps": "5"})


def test_round_trip(tmp_path: Path) -> None:
    original = lens()
    path = save_affine_lens(tmp_path / "lens.safetensors", original, model="tiny", num_layers=4)
    back = load_affine_lens(path)
    assert back.kind == "tuned" and back.layers == [0, 3]
    for i in back.layers:
        np.testing.assert_array_equal(back.weights[i], original.weights[i])
        np.testing.assert_array_equal(back.biases[i], original.biases[i])
    assert back.meta["format"] == "lens-evals-affine-lens" and back.meta["model"] == "tiny"
    assert back.meta["hidden_size"] == "8" and back.meta["num_layers"] == "4" and back.meta["steps"] == "5"
    h = np.ones((2, 8), dtype=np.float32)
    np.testing.assert_allclose(back.apply(3, h), h @ original.weights[3].T + original.biases[3], rtol=1e-6)


def write(path: Path, tensors: dict[str, np.ndarray], **meta: str) -> Path:
    save_file(tensors, str(path), metadata={"format": "lens-evals-affine-lens", "kind": "tuned", "model": "m", **meta})
    return path


EYE, ZERO = np.eye(4, dtype=np.float32), np.zeros(4, dtype=np.float32)


@pytest.mark.parametrize(
    ("tensors", "meta", "message"),
    [
        ({"weight.0": EYE, "bias.0": ZERO}, {"format": "something-else"}, "metadata format is 'something-else'"),
        ({"weight.0": EYE, "bias.0": ZERO}, {"kind": "logit"}, "kind must be one of tuned, jacobian"),
        ({"weight.0": EYE[:, :3].copy(), "bias.0": ZERO}, {}, "weight.0 has shape [4, 3], expected [4, 4]"),
        ({"weight.0": EYE, "bias.0": ZERO[:3].copy()}, {}, "bias.0 has shape [3], expected [4]"),
        ({"weight.0": EYE.astype(np.float16), "bias.0": ZERO}, {}, "weight.0 must be float32, got float16"),
        ({"weight.0": EYE * np.nan, "bias.0": ZERO}, {}, "weight.0 holds NaN or infinite values"),
        ({"weight.0": EYE}, {}, "layers with a weight [0] differ from layers with a bias []"),
        ({"weight.0": EYE, "bias.0": ZERO, "extra": ZERO}, {}, "unexpected tensor 'extra'"),
        (
            {"weight.0": EYE, "bias.0": ZERO, "weight.1": np.eye(5, dtype=np.float32), "bias.1": np.zeros(5, np.float32)},
            {},
            "weight.1 has shape [5, 5]",
        ),
        ({"weight.0": EYE, "bias.0": ZERO}, {"hidden_size": "8"}, "metadata hidden_size=8 but the weights are [4, 4]"),
        ({"weight.5": EYE, "bias.5": ZERO}, {"num_layers": "4"}, "layer 5 is not below metadata num_layers=4"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str], message: str) -> None:
    path = write(tmp_path / "bad.safetensors", tensors, **meta)
    with pytest.raises(LensFileError) as caught:
        load_affine_lens(path)
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_a_pickle_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "lens.safetensors"

    class Boom:
        def __reduce__(self):  # would run on unpickling
            return (Path(tmp_path / "ran").touch, ())

    path.write_bytes(pickle.dumps({"weight.0": Boom()}))
    with pytest.raises(LensFileError, match="not a readable safetensors file"):
        load_affine_lens(path)
    assert not (tmp_path / "ran").exists()
    with pytest.raises(LensFileError, match="does not exist"):
        load_affine_lens(tmp_path / "missing.safetensors")


def test_the_writer_refuses_what_the_loader_would(tmp_path: Path) -> None:
    bad = lens()
    bad.biases[3] = bad.biases[3].astype(np.float64)
    with pytest.raises(LensFileError, match="bias.3 must be float32"):
        save_affine_lens(tmp_path / "x.safetensors", bad, model="m", num_layers=4)
    assert not (tmp_path / "x.safetensors").exists()
