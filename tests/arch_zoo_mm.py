"""Multimodal models of the architecture zoo (tests/arch_zoo.py): the language tower as tiny as
the zoo's text-only sibling, the vision tower tiny too, run with text-only prompts.

Each entry: the composite config's model type, its sub-configs (model type and overrides; the
zoo's common shape fills the rest) and top-level overrides. The vision tower has as many layers
as the language tower, so a layer finder that takes the first list of that length finds the
vision tower's. Image / video token ids are tokens of the tiny tokenizer that the matrix's prompt
never produces (508-511 are the digit strings "147"-"150").
"""

from __future__ import annotations

from typing import Any

# as arch_zoo's Gemma3ForCausalLM: 3 layers, sliding window 8 on the first two
_GEMMA3_TEXT: dict[str, Any] = dict(
    num_hidden_layers=3,
    sliding_window=8,
    query_pre_attn_scalar=32,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
)
_SIGLIP: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, image_size=28, patch_size=14
)

# vLLM builds the model's HF processor at start-up (to profile the vision tower): its files, with the
# image / video tokens named in the tokenizer's config (checked on CPU for Gemma 3, with
# transformers' PIL image processor; Qwen2.5-VL's video processor needs torchvision: unchecked)
_MEAN_STD = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
_QWEN_PIXELS = dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12544, **_MEAN_STD)
_GEMMA3_FILES: dict[str, dict[str, Any]] = {
    "tokenizer_config.json": {"extra_special_tokens": {"boi_token": "148", "eoi_token": "149", "image_token": "150"}},
    "preprocessor_config.json": dict(
        image_processor_type="Gemma3ImageProcessor", processor_class="Gemma3Processor", size={"height": 28, "width": 28}, **_MEAN_STD
    ),
    "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": 4},
}
_QWEN_FILES: dict[str, dict[str, Any]] = {
    "tokenizer_config.json": {
        "extra_special_tokens": {"vision_start_token": "147", "vision_end_token": "148", "video_token": "149", "image_token": "150"}
    },
    "preprocessor_config.json": dict(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor", **_QWEN_PIXELS),
    "video_preprocessor_config.json": dict(
        video_processor_type="Qwen2VLVideoProcessor", processor_class="Qwen2_5_VLProcessor", **_QWEN_PIXELS
    ),
    "processor_config.json": {"processor_class": "Qwen2_5_VLProcessor"},
}

MULTIMODAL: dict[str, dict[str, Any]] = {
    "Gemma3ForConditionalGeneration": dict(
        model_type="gemma3",
        sub_configs={"text_config": ("gemma3_text", _GEMMA3_TEXT), "vision_config": ("siglip_vision_model", _SIGLIP)},
        overrides=dict(mm_tokens_per_image=4, boi_token_index=509, eoi_token_index=510, image_token_index=511, tie_word_embeddings=True),
        note="vision tower: SigLIP, 3 layers (as many as the language tower)",
        files=_GEMMA3_FILES,
    ),
    "Qwen2_5_VLForConditionalGeneration": dict(
        model_type="qwen2_5_vl",
        sub_configs={
            # M-RoPE over the head's 16 frequency pairs, as the real model's [16, 24, 24] over 64
            "text_config": ("qwen2_5_vl_text", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[4, 6, 6]))),
            "vision_config": (
                "qwen2_5_vl_vision",
                dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, fullatt_block_indexes=[1]),
            ),
        },
        overrides=dict(image_token_id=511, video_token_id=510, vision_start_token_id=508, vision_end_token_id=509),
        note="M-RoPE (mrope_section [4, 6, 6]); vision tower: 2 blocks (as many as the language tower)",
        files=_QWEN_FILES,
    ),
}
