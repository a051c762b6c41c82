"""Built-in hooks, registered by name on every server (see ``lens_evals.request.hooks.BUILTIN_HOOKS``).

Each is ``fn(ctx, hidden) -> Tensor | None`` with JSON ``args`` checked by its ``args_model``:
at admission against the request's and model's bounds (``lens_evals.request.hooks.HookBounds``, the
validation context), on the worker again without them. Positions are absolute token positions
(prompt and generated tokens counted from 0).
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from lens_evals.engine.transport.probe_cache import LRU
from lens_evals.request.hooks import BOUNDS_CONTEXT, HookBounds
from lens_evals.request.wire_model import Float32, check_scaled, float32_array


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


def bounds_of(info: ValidationInfo) -> HookBounds | None:
    """The admission's bounds (None on the worker, which validates the args again)."""
    context = info.context
    bounds = context.get(BOUNDS_CONTEXT) if isinstance(context, dict) else None
    return bounds if isinstance(bounds, HookBounds) else None


def _positions(value: list[int] | None, info: ValidationInfo) -> list[int] | None:
    """Unique, >= 0 and, at admission, inside the request (so at most as many as it has)."""
    if value is None:
        return None
    bounds = bounds_of(info)
    limit = None if bounds is None else bounds.max_positions
    if limit is not None and len(value) > limit:
        raise ValueError(f"{len(value)} positions, more than the {limit} this request has")
    if value and min(value) < 0:
        raise ValueError(f"positions must be >= 0, got {min(value)}")
    if len(set(value)) != len(value):
        raise ValueError("positions has duplicates")
    if limit is not None and value and max(value) >= limit:
        raise ValueError(f"position {max(value)} out of range: this request has at most {limit} positions (0..{limit - 1})")
    return value


Positions = Annotated[list[int], AfterValidator(_positions)]


def _row_mask(ctx: Any, positions: list[int] | None) -> torch.Tensor | None:
    """Rows of this call at the given absolute positions (None: every row)."""
    if positions is None:
        return None
    wanted = torch.tensor(positions, dtype=ctx.positions.dtype, device=ctx.positions.device)
    return torch.isin(ctx.positions, wanted)


def matched_rows(ctx: Any, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of this call whose position is in ``positions``, the index in ``positions`` of each
    row's position: its first occurrence), by a sort and a binary search instead of a loop."""
    if not positions:
        nothing = torch.zeros(0, dtype=torch.long, device=ctx.positions.device)
        return nothing, nothing
    wanted = torch.tensor(positions, dtype=ctx.positions.dtype, device=ctx.positions.device)
    ordered, order = torch.sort(wanted, stable=True)
    slot = torch.searchsorted(ordered, ctx.positions).clamp_(max=len(positions) - 1)
    rows = (ordered[slot] == ctx.positions).nonzero().squeeze(1)
    return rows, order[slot[rows]]


def check_rows(name: str, value: Any, bounds: HookBounds, rows: int | None, single: bool = True) -> np.ndarray:
    """``value`` as a float32 array of shape (width,) (if ``single``) or (rows, width) (if ``rows``)."""
    try:
        array = float32_array(value)
    except ValueError:
        raise ValueError(f"{name} must be a numeric array") from None
    width = "width" if bounds.width is None else bounds.width
    shapes = ([f"({width},)"] if single else []) + ([] if rows is None else [f"({rows}, {width})"])
    fits = (single and array.ndim == 1) or (rows is not None and array.ndim == 2 and array.shape[0] == rows)
    if not fits or array.shape[-1] == 0 or bounds.width not in (None, array.shape[-1]):
        raise ValueError(f"{name} must be {' or '.join(shapes)}, got shape {array.shape}")
    return array


def append_rows(saved: dict[str, Any], key: str, rows: torch.Tensor) -> None:
    """Grow ``saved[key]`` along dim 0 (calls come once per step, in position order)."""
    previous = saved.get(key)
    saved[key] = rows if previous is None else torch.cat([previous, rows])


class AblateArgs(_Args):
    indices: list[int] = Field(min_length=1)
    value: Float32 = 0.0
    positions: Positions | None = None

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> AblateArgs:
        bounds = bounds_of(info)
        if min(self.indices) < 0 or len(set(self.indices)) != len(self.indices):
            raise ValueError("indices must be unique and >= 0")
        if bounds is not None and bounds.width is not None and max(self.indices) >= bounds.width:
            raise ValueError(f"index {max(self.indices)} out of range: the rows have {bounds.width} columns")
        return self


def ablate(ctx: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Set columns ``indices`` of the hooked tensor to ``value`` (at ``positions``, or every row).
    With ``module="mlp.down_proj", pre=True`` the columns are MLP neurons (single GPU / TP 1)."""
    args = AblateArgs.model_validate(ctx.args)
    columns = torch.tensor(args.indices, device=hidden.device)
    mask = _row_mask(ctx, args.positions)
    out = hidden.clone()
    if mask is None:
        out[:, columns] = args.value
    else:
        out[mask.nonzero().squeeze(1)[:, None], columns] = args.value
    return out


ablate.args_model = AblateArgs  # type: ignore[attr-defined]


class AddArgs(_Args):
    vector: Any  # (hidden,) or (len(positions), hidden)
    positions: Positions | None = None
    scale: Float32 = 1.0

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> AddArgs:
        bounds = bounds_of(info)
        if bounds is not None:  # the worker's vector is a device tensor, checked here already
            rows = None if self.positions is None else len(self.positions)
            check_scaled("vector", check_rows("vector", self.vector, bounds, rows), self.scale)
        return self


def add(ctx: Any, hidden: torch.Tensor) -> torch.Tensor | None:
    """Add ``scale * vector`` to the rows at ``positions`` (e.g. noise on the subject tokens of a
    corrupted run in causal tracing: a pre-hook at layer 0 adds it to the embeddings)."""
    args = AddArgs.model_validate(ctx.args)
    vector = torch.as_tensor(args.vector, device=hidden.device, dtype=hidden.dtype)
    if args.positions is None:
        return hidden + args.scale * vector
    rows, index = matched_rows(ctx, args.positions)
    if rows.numel() == 0:
        return None
    out = hidden.clone()
    out.index_add_(0, rows, args.scale * (vector.expand(len(rows), -1) if vector.dim() == 1 else vector[index]))
    return out


add.args_model = AddArgs  # type: ignore[attr-defined]


class PatchArgs(_Args):
    positions: Positions = Field(min_length=1)
    values: Any  # (len(positions), hidden): the states to put in

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> PatchArgs:
        bounds = bounds_of(info)
        if bounds is not None:
            check_scaled("values", check_rows("values", self.values, bounds, len(self.positions), single=False), 1.0)
        return self


def patch(ctx: Any, hidden: torch.Tensor) -> torch.Tensor | None:
    """Replace the rows at ``positions`` by ``values`` (causal tracing: restore a clean state)."""
    args = PatchArgs.model_validate(ctx.args)
    values = torch.as_tensor(args.values, device=hidden.device, dtype=hidden.dtype)
    if values.dim() != 2 or values.shape[0] != len(args.positions):
        raise ValueError(f"values must be (len(positions), hidden), got {tuple(values.shape)}")
    rows, index = matched_rows(ctx, args.positions)
    if rows.numel() == 0:
        return None
    return hidden.clone().index_copy_(0, rows, values[index])


patch.args_model = PatchArgs  # type: ignore[attr-defined]


class RecordArgs(_Args):
    positions: Positions | None = None


def record(ctx: Any, hidden: torch.Tensor) -> None:
    """saved["rows.<layer>"]: the hooked rows (at ``positions``, or all), saved["positions.<layer>"]
    their positions; with ``pre=True`` at layer 0 these are the token embeddings."""
    mask = _row_mask(ctx, RecordArgs.model_validate(ctx.args).positions)
    rows, positions = (hidden, ctx.positions) if mask is None else (hidden[mask], ctx.positions[mask])
    site = f"{ctx.module_path}." if ctx.module_path else ""
    append_rows(ctx.saved, f"{site}rows.{ctx.layer_idx}", rows)
    append_rows(ctx.saved, f"{site}positions.{ctx.layer_idx}", positions)


record.args_model = RecordArgs  # type: ignore[attr-defined]


def record_norm(ctx: Any, hidden: torch.Tensor) -> None:
    """saved["norm.<layer>"]: the L2 norm of each row; saved["positions.<layer>"]: their positions."""
    append_rows(ctx.saved, f"norm.{ctx.layer_idx}", hidden.float().norm(dim=-1))
    append_rows(ctx.saved, f"positions.{ctx.layer_idx}", ctx.positions)


record_norm.args_model = _Args  # type: ignore[attr-defined]


class LogitLensArgs(_Args):
    top_k: int = Field(default=5, ge=0, le=100)
    positions: Positions | None = None
    token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=1000)
    norm: str = "model.norm.weight"
    unembedding: str = "lm_head.weight"

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> LogitLensArgs:
        bounds = bounds_of(info)
        if bounds is not None and self.token_ids and max(self.token_ids) >= bounds.vocab_size:
            raise ValueError(f"token id {max(self.token_ids)} out of range: the vocabulary has {bounds.vocab_size} tokens")
        return self


# (data_ptr, dtype, shape, stride, device, version) -> (the weight, its float32 copy): built once per
# worker, not at every call (a bfloat16 unembedding of 128k x 8k is a 4 GiB copy per layer and
# step). The weight is held, so its memory (and pointer) cannot go to another tensor meanwhile;
# an in-place update of the weight bumps its version and makes a new copy.
_float32_weights: LRU[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = LRU(8)


def float32_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight.float()``, cached per weight (the same tensor object while the weight is unchanged).
    An inference tensor (a tensor-parallel weight gathered for this call) is made afresh each call
    and has no version counter: its address may be reused by the next gather with other values,
    so it is converted, never cached."""
    if weight.is_inference():
        return weight.float()
    key = (weight.data_ptr(), weight.dtype, tuple(weight.shape), weight.stride(), str(weight.device), weight._version)
    return _float32_weights.get_or_make(key, lambda: (weight, weight.float()))[1]


def logit_lens(ctx: Any, hidden: torch.Tensor) -> None:
    """Project the stream through the final RMSNorm and the unembedding (Llama-style names by
    default): saved["top_ids.<layer>"], ["top_logprobs.<layer>"] (rows, top_k), with ``token_ids``
    ["token_logprobs.<layer>"] (rows, len(token_ids)), and ["positions.<layer>"]."""
    args = LogitLensArgs.model_validate(ctx.args)
    mask = _row_mask(ctx, args.positions)
    rows = hidden if mask is None else hidden[mask]
    if rows.shape[0] == 0:
        return None
    eps = float(getattr(ctx.hf_config, "rms_norm_eps", 1e-6))
    stream = rows.float()
    norm = float32_weight(ctx.get_parameter(args.norm))
    normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + eps) * norm
    logprobs = torch.log_softmax(normed @ float32_weight(ctx.get_parameter(args.unembedding)).T, dim=-1)
    layer = ctx.layer_idx
    if args.top_k:
        top = logprobs.topk(args.top_k, dim=-1)
        append_rows(ctx.saved, f"top_ids.{layer}", top.indices)
        append_rows(ctx.saved, f"top_logprobs.{layer}", top.values)
    if args.token_ids:
        append_rows(ctx.saved, f"token_logprobs.{layer}", logprobs[:, torch.tensor(args.token_ids, device=logprobs.device)])
    append_rows(ctx.saved, f"positions.{layer}", ctx.positions if mask is None else ctx.positions[mask])
    return None


logit_lens.args_model = LogitLensArgs  # type: ignore[attr-defined]
