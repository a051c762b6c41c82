"""Fitted files as readout requests (lens_evals.readouts.requests): an SAE-Lens folder and an affine
lens file become the request objects the worker reads, and the worker's math on them
(engine/worker/readouts.py) equals the host's reference math on the loaded files
(lens_evals.readouts.reference) — two implementations written apart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lens_evals.engine.worker import readouts as worker
from lens_evals.readouts import reference
from lens_evals.readouts.lens_files import AffineLensWeights, load_affine_lens, save_affine_lens
from lens_evals.readouts.requests import lens_readout, sae_readout
from lens_evals.readouts.sae_files import load_sae, save_sae
from tests.readouts.test_sae_files import sae


@pytest.mark.parametrize("architecture", ["standard", "topk", "jumprelu"])
def test_sae_folder_as_a_readout_equals_the_reference(tmp_path: Path, architecture: str) -> None:
    folder = save_sae(tmp_path / "sae", sae(d_in=6, d_sae=10, architecture=architecture), model="tiny")
    readout = sae_readout(folder, name="s", top_k=4)
    assert readout.layer == 15 and readout.sae.activation == {"standard": "relu"}.get(architecture, architecture)
    [decoded] = worker.decode_readouts([readout.to_wire()], torch.device("cpu"))
    assert decoded.sae is not None
    stream = torch.from_numpy(np.random.default_rng(1).normal(size=(9, 6)).astype(np.float32))
    got = worker.sae_topk(stream, decoded.sae, 4)
    expected = reference.sae_topk(stream, load_sae(folder), 4)
    assert torch.equal(got[:, :4].to(torch.int32), torch.from_numpy(expected["latent_ids"]))
    torch.testing.assert_close(got[:, 4:], torch.from_numpy(expected["values"]), rtol=1e-5, atol=1e-6)
    assert (expected["latent_ids"] >= 0).any()  # some latent fires: the comparison is not empty


def test_affine_lens_file_as_a_readout_keeps_each_layers_translator(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    layers, d = [1, 3], 5
    weights = {layer: rng.normal(size=(d, d)).astype(np.float32) for layer in layers}
    biases = {layer: rng.normal(size=d).astype(np.float32) for layer in layers}
    path = save_affine_lens(tmp_path / "tuned.safetensors", AffineLensWeights("tuned", weights, biases), model="tiny", num_layers=4)
    readout = lens_readout(path, name="t", layers=[3], top_k=2)
    assert readout.layers == [3] and readout.lens is not None and readout.lens.layers == [3]
    loaded = load_affine_lens(path)
    np.testing.assert_array_equal(readout.lens.weights[0], loaded.weights[3])
    np.testing.assert_array_equal(readout.lens.biases[0], loaded.biases[3])
    assert lens_readout(path).layers == layers  # "all": every layer the file has
    with pytest.raises(ValueError, match=r"no translator for layers \[2\]"):
        lens_readout(path, layers=[2])
