"""A causal LM whose decoder layers are linear maps acting on each position alone (no attention,
no residual): the residual stream after layer i is ``h_i = W_i ... W_0 e``, so the Jacobian of the
last layer's stream with respect to layer i's is the product ``W_{L-1} ... W_{i+1}``, known
exactly. Laid out as HF transformers' Llama (``model.layers``, ``model.norm``, ``lm_head``) so the
fitting code runs on it unchanged."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


class LinearLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, hidden: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.proj(hidden)


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LinearDecoder(nn.Module):
    def __init__(self, vocab: int, d: int, n_layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LinearLayer(d) for _ in range(n_layers))
        self.norm = RMSNorm(d)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


class LinearLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, n_layers: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(hidden_size=d, final_logit_softcapping=None)
        self.model = LinearDecoder(vocab, d, n_layers)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():  # well-conditioned layers: identity plus a random perturbation
            for layer in self.model.layers:
                layer.proj.weight.copy_(torch.eye(d) + 0.3 * torch.randn(d, d) / d**0.5)
            self.model.norm.weight.uniform_(0.5, 1.5)
        for parameter in self.parameters():
            parameter.requires_grad_(False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))

    def jacobian(self, layer: int) -> torch.Tensor:
        """``d h_last / d h_layer``: the product of the later layers' matrices."""
        d = self.config.hidden_size
        product = torch.eye(d)
        for later in self.model.layers[layer + 1 :]:
            product = later.proj.weight @ product
        return product
