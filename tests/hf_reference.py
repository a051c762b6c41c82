"""Independent reference: HF transformers on the same weights, fp32."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


class HFReference:
    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        self.model.eval()
        self.layers = self.model.model.layers

    @torch.no_grad()
    def residual_stream(
        self, token_ids: Sequence[int], layers: Sequence[int], additions: dict[int, dict[int, torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """(n_layers, n_tokens, hidden): each decoder layer's output, i.e. the residual stream
        after layer i (``hidden_states[i + 1]`` for all but the last layer, which HF normalises).
        ``additions[layer][position]`` is added to the stream after that layer first."""
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_hook(self._hook(index, captured, (additions or {}).get(index, {}))))
        try:
            self.model(torch.tensor([list(token_ids)]))
        finally:
            for handle in handles:
                handle.remove()
        return torch.stack([captured[i] for i in layers])

    @staticmethod
    def _hook(index: int, captured: dict[int, torch.Tensor], adds: dict[int, torch.Tensor]):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if adds:
                hidden = hidden.clone()
                for pos, vec in adds.items():
                    hidden[0, pos] += vec
            captured[index] = hidden[0].clone()
            if adds:
                return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
            return None

        return hook

    @torch.no_grad()
    def hidden_states(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
        out = self.model(torch.tensor([list(token_ids)]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)
