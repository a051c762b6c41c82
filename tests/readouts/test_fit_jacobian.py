"""The Jacobian lens: on a model whose layers are linear per position, the fitted lens is the
product of the later layers' matrices (both cotangent kinds); on a random Llama it is the
average same-position Jacobian, checked against per-token Jacobians by autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.readouts.hf_parts import model_parts
from lens_evals.readouts.jacobian import JacobianSettings, fit_jacobian_lens
from tests.arch_zoo import build
from tests.readouts.linear_lm import LinearLM

PROMPTS = [[3, 5, 7, 9, 11, 13, 2, 4, 6, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.mark.parametrize("probes", ["rademacher", "basis"])
def test_linear_layers_give_the_product_of_their_matrices(probes: str) -> None:
    model = LinearLM(vocab=64, d=16, n_layers=4)
    lens = fit_jacobian_lens(
        model_parts(model), PROMPTS, [0, 1, 2, 3], JacobianSettings(probes=probes, copies=4, skip_first=2), progress=False
    )
    assert lens.kind == "jacobian" and lens.layers == [0, 1, 2, 3]
    for layer in (0, 1, 2):
        np.testing.assert_allclose(lens.weights[layer], model.jacobian(layer).numpy(), atol=2e-5)
        assert not np.allclose(lens.weights[layer], np.eye(16), atol=0.1)
        assert (lens.biases[layer] == 0).all()
    np.testing.assert_array_equal(lens.weights[3], np.eye(16, dtype=np.float32))


def same_position_jacobians(parts, ids: list[int], layer: int, skip: int) -> torch.Tensor:
    """``[n_pos - skip, d, d]``: d h_last[t] / d h_layer[t] for each position t >= skip, by autograd.functional."""
    caught: dict[str, torch.Tensor] = {}
    last = parts.num_layers - 1
    with torch.no_grad():
        handle = parts.layers[layer].register_forward_hook(
            lambda m, a, o: caught.__setitem__("h", (o if torch.is_tensor(o) else o[0]).clone())
        )
        parts.decoder(input_ids=torch.tensor([ids]))
        handle.remove()
    base = caught["h"]
    out = []
    for t in range(skip, len(ids)):

        def run(row: torch.Tensor, t: int = t) -> torch.Tensor:
            def replace(m, a, o):
                hidden = (o if torch.is_tensor(o) else o[0]).clone()
                hidden[0, t] = row
                return hidden if torch.is_tensor(o) else (hidden, *o[1:])

            got: dict[str, torch.Tensor] = {}
            handles = [
                parts.layers[layer].register_forward_hook(replace),
                parts.layers[last].register_forward_hook(lambda m, a, o: got.__setitem__("h", o if torch.is_tensor(o) else o[0])),
            ]
            try:
                parts.decoder(input_ids=torch.tensor([ids]))
            finally:
                for h in handles:
                    h.remove()
            return got["h"][0, t]

        out.append(torch.autograd.functional.jacobian(run, base[0, t], vectorize=True))
    return torch.stack(out)


@pytest.mark.slow  # per-token Jacobians by autograd: ~10 s alone, 2 min on the shared 2-core machine
def test_random_llama_average_same_position_jacobian() -> None:
    """Attention mixes positions: the cross-position terms are zero-mean noise, so the fit
    (basis cotangents, many repeats of one prompt) approaches the mean per-token Jacobian."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(build("LlamaForCausalLM")), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    parts = model_parts(model)
    ids = [1, 40, 41, 42, 43, 44, 45]
    exact = same_position_jacobians(parts, ids, 0, skip=2).mean(0)
    lens = fit_jacobian_lens(parts, [ids] * 4, [0], JacobianSettings(probes="basis", copies=128, skip_first=2), progress=False)
    got = torch.from_numpy(lens.weights[0])
    identity_err = (torch.eye(128) - exact).norm() / exact.norm()
    err = (got - exact).norm() / exact.norm()
    assert err < 0.25 * identity_err, (err, identity_err)
