"""A zoo of tiny random fp32 decoder-only models, one per architecture that both vLLM's registry
and transformers implement, to check that the plugin reads the residual stream right on each
(against HF ``hidden_states``). Built offline from transformers config classes, with the tiny
BPE tokenizer of ``tiny-llama`` (vocab 512).

``ZOO[arch].config()`` gives the transformers config; ``build(arch)`` writes (once, cached) a
directory that ``AutoModelForCausalLM.from_pretrained`` and vLLM both load. Shapes: 2 decoder
layers (3 where layer kinds alternate, with every kind present), hidden 128, 4 heads of 32
(vLLM's CPU attention takes head_dim 32/64/80/96/112/128...), 2 KV heads where supported, MoE
with 4 experts top-2. Weights: seed 0, every >=2-D weight ~ N(0, 0.08); norm weights
non-trivial (1 + U(-0.5, 0.5), or U(-0.5, 0.5) for norms stored as an offset from 1) and norm
biases ~ N(0, 0.1), since unit norms hide a wrong residual stream; other 1-D parameters get
their default plus N(0, 0.05).

``VLLM_CPU_RUNS``: the architectures vLLM 0.32 (CPU build) loads and runs (measured: plain
engine, plugin disabled, greedy tokens compared with HF); ``VLLM_CPU_FAILS`` the others, with
the reason; ``VLLM_CPU_TOKENS_DIFFER`` those whose greedy tokens differ from HF's (near-ties).
``SKIPPED``: registry architectures not in the zoo, with the reason. Some entries set fields of
the original (remote-code) configs that vLLM reads but transformers' config classes lack, or
deviate from the real model where HF and vLLM disagree on the checkpoint; ``ZooEntry.note``
says so.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.arch_zoo_mm import MULTIMODAL

ZOO_VERSION = 2
TOKENIZER_SOURCE = "tiny-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
READY = ".zoo_ready"

# The tiny tokenizer: byte-level BPE, vocab 512, specials <|unk|> 0, <|bos|> 1, <|eos|> 2 (also pad).
VOCAB = 512
BOS = 1
EOS = 2
PAD = 2

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
FFN = 256
EXPERTS = 4
TOP_K = 2
EXPERT_FFN = 64
WINDOW = 8  # sliding window, small enough to matter on the test prompts
MAX_POS = 2048

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=PAD,
    max_position_embeddings=MAX_POS,
    tie_word_embeddings=False,
)
ATTN: dict[str, Any] = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    intermediate_size=FFN,
    num_hidden_layers=2,
)
SWA3 = ["sliding_attention", "sliding_attention", "full_attention"]
# DeepSeek-style multi-head latent attention. vLLM's CPU MLA kernel only takes a latent of
# kv_lora_rank 512 + rope 64 (DeepSeek's own), so those two stay full size.
MLA: dict[str, Any] = dict(
    num_key_value_heads=HEADS,
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    head_dim=64,
)
DS_MOE: dict[str, Any] = dict(
    n_routed_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    n_shared_experts=1,
    moe_intermediate_size=EXPERT_FFN,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
)


def _config(model_type: str, arch: str, **overrides: Any):
    """A transformers config of ``model_type``: the common shape (only the keys this config
    class knows) updated with ``overrides``, dtype float32, ``architectures=[arch]``."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = CONFIG_MAPPING[model_type]()
    fields = set(known.to_dict()) | set(getattr(known, "attribute_map", {}))
    kwargs = {
        k: v for k, v in {**COMMON, **ATTN}.items()
        if k in fields and not isinstance(getattr(type(known), k, None), property)
    }
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    config.architectures = [arch]
    config.dtype = torch.float32
    return config


@dataclass(frozen=True)
class ZooEntry:
    arch: str  # as in config.json "architectures" (vLLM registry key)
    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    hf_class: str | None = None  # transformers class, when its name differs from ``arch``
    note: str = ""
    drop_weights: str | None = None  # regex of saved tensors vLLM does not expect (removed after saving)
    # composite (multimodal) configs: sub-config name -> (model type, overrides), each filled with the common shape
    sub_configs: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # JSON files written (tokenizer_config.json: merged)

    def config(self):
        import torch

        gpu = GPU_OVERRIDES.get(self.arch, {}) if torch.cuda.is_available() else {}
        subs = {}
        for name, (model_type, overrides) in self.sub_configs.items():
            subs[name] = {k: v for k, v in _config(model_type, self.arch, **overrides).to_dict().items() if k != "architectures"}
        return _config(self.model_type, self.arch, **(self.overrides | subs | gpu))

    def __call__(self):
        return self.config()

    @property
    def model_class_name(self) -> str:
        return self.hf_class or self.arch


def _e(arch: str, model_type: str, hf_class: str | None = None, note: str = "", drop_weights: str | None = None,
       **overrides: Any) -> ZooEntry:
    return ZooEntry(arch, model_type, overrides, hf_class, note, drop_weights)


_ENTRIES = [
    # ---- Llama family
    _e("LlamaForCausalLM", "llama"),
    _e("MistralForCausalLM", "mistral", sliding_window=None),
    _e(
        "Ministral3ForCausalLM",
        "ministral3",
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=512,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1,
        ),
    ),
    _e("MixtralForCausalLM", "mixtral", num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN),
    _e("ApertusForCausalLM", "apertus", rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    _e("ArceeForCausalLM", "arcee"),
    _e("CwmForCausalLM", "cwm", num_hidden_layers=3, sliding_window=WINDOW,
       layer_types=["full_attention", "sliding_attention", "sliding_attention"],
       rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    _e("HyperCLOVAXForCausalLM", "hyperclovax", embedding_multiplier=2.0, residual_multiplier=0.5,
       attention_multiplier=HEAD_DIM ** -0.5, logits_scaling=2.0),
    _e("SmolLM3ForCausalLM", "smollm3", no_rope_layer_interval=2, no_rope_layers=[1, 0]),
    _e("Llama4ForCausalLM", "llama4_text", intermediate_size=EXPERT_FFN, intermediate_size_mlp=FFN,
       num_local_experts=EXPERTS, num_experts_per_tok=1, interleave_moe_layer_step=2, moe_layers=[1],
       no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"], attention_chunk_size=128,
       note="top-1 routing as the real model; attention chunk 128 (vLLM needs a multiple of its block size)"),
    # ---- Qwen
    _e("Qwen2ForCausalLM", "qwen2"),
    _e("Qwen2MoeForCausalLM", "qwen2_moe", num_experts=EXPERTS, num_experts_per_tok=TOP_K,
       moe_intermediate_size=EXPERT_FFN, shared_expert_intermediate_size=128),
    _e("Qwen3ForCausalLM", "qwen3"),
    _e("Qwen3MoeForCausalLM", "qwen3_moe", num_experts=EXPERTS, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
       moe_intermediate_size=EXPERT_FFN, norm_topk_prob=True),
    # ---- Gemma
    _e("GemmaForCausalLM", "gemma"),
    # vLLM's Gemma 2 / 3n always tie lm_head to the embedding (as the real ones do)
    _e("Gemma2ForCausalLM", "gemma2", num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM,
       layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True),
    _e("Gemma3ForCausalLM", "gemma3_text", num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM,
       layer_types=SWA3),
    _e("Gemma3nForCausalLM", "gemma3n_text", num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3,
       intermediate_size=[FFN] * 3, activation_sparsity_pattern=[0.0] * 3, vocab_size_per_layer_input=VOCAB,
       hidden_size_per_layer_input=16, num_kv_shared_layers=0, laurel_rank=8, altup_num_inputs=2,
       tie_word_embeddings=True),
    _e("Gemma4ForCausalLM", "gemma4_text", num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3,
       global_head_dim=2 * HEAD_DIM, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
       note="full-attention layers use head_dim 64 (per-layer config), as the real model does",
       rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=1e4),
                            full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6))),
    _e("VaultGemmaForCausalLM", "vaultgemma", num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM,
       layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # ---- Phi
    _e("PhiForCausalLM", "phi", num_key_value_heads=HEADS),
    _e("Phi3ForCausalLM", "phi3"),
    _e("PhiMoEForCausalLM", "phimoe", hf_class="PhimoeForCausalLM", num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
       intermediate_size=EXPERT_FFN, sliding_window=None),
    # ---- OLMo
    _e("OlmoForCausalLM", "olmo", clip_qkv=8.0),
    _e("Olmo2ForCausalLM", "olmo2"),
    _e("Olmo3ForCausalLM", "olmo3", num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3),
    _e("OlmoeForCausalLM", "olmoe", num_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN),
    _e("FlexOlmoForCausalLM", "flex_olmo", num_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN),
    # ---- Granite (non-trivial multipliers)
    _e("GraniteForCausalLM", "granite", embedding_multiplier=2.0, residual_multiplier=0.5,
       attention_multiplier=HEAD_DIM ** -0.5, logits_scaling=2.0),
    _e("GraniteMoeForCausalLM", "granitemoe", embedding_multiplier=2.0, residual_multiplier=0.5,
       attention_multiplier=HEAD_DIM ** -0.5, logits_scaling=2.0,
       num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN),
    _e("GraniteMoeSharedForCausalLM", "granitemoeshared", embedding_multiplier=2.0, residual_multiplier=0.5,
       attention_multiplier=HEAD_DIM ** -0.5, logits_scaling=2.0,
       num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN, shared_intermediate_size=64),
    _e("GraniteMoeSWAForCausalLM", "granitemoe_swa", embedding_multiplier=2.0, residual_multiplier=0.5,
       attention_multiplier=HEAD_DIM ** -0.5, logits_scaling=2.0,
       num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN, shared_intermediate_size=64,
       num_hidden_layers=3, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
       layer_rope_theta=[1e4] * 3),
    _e("GraniteSWAForCausalLM", "granite_swa", embedding_multiplier=2.0, residual_multiplier=0.5,
       attention_multiplier=HEAD_DIM ** -0.5, logits_scaling=2.0,
       num_hidden_layers=3, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
       layer_rope_theta=[1e4] * 3),
    # ---- GPT-2 / NeoX / J / BigCode / OPT / Bloom / Falcon
    _e("GPT2LMHeadModel", "gpt2", n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_inner=FFN, n_positions=MAX_POS,
       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    _e("GPTJForCausalLM", "gptj", n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_inner=FFN, n_positions=MAX_POS, rotary_dim=16,
       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    _e("GPTBigCodeForCausalLM", "gpt_bigcode", n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_inner=FFN, n_positions=MAX_POS,
       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, multi_query=True, num_key_value_heads=1),
    _e("GPTNeoXForCausalLM", "gpt_neox", num_key_value_heads=HEADS),
    _e("OPTForCausalLM", "opt", ffn_dim=FFN, word_embed_proj_dim=HIDDEN, dropout=0.0),
    _e("BloomForCausalLM", "bloom", n_layer=2, n_head=HEADS, tie_word_embeddings=True,
       note="tied: vLLM's Bloom cannot load a separate lm_head"),
    _e("FalconForCausalLM", "falcon", ffn_hidden_size=4 * HIDDEN, num_kv_heads=1, multi_query=True, parallel_attn=True,
       note="Falcon-7B layout (multi-query, parallel attention); vLLM's Falcon assumes ffn = 4 * hidden"),
    _e("Starcoder2ForCausalLM", "starcoder2"),
    _e("StableLmForCausalLM", "stablelm", num_key_value_heads=HEADS, use_qkv_bias=True),
    # ---- DeepSeek / MLA
    _e("DeepseekV2ForCausalLM", "deepseek_v2", **MLA, **DS_MOE, topk_method="greedy"),
    _e("DeepseekV3ForCausalLM", "deepseek_v3", **MLA, **DS_MOE, num_nextn_predict_layers=0, topk_method="noaux_tc",
       scoring_func="sigmoid"),
    _e("DeepseekV32ForCausalLM", "deepseek_v32", **MLA, **DS_MOE, index_topk=16, index_head_dim=128, index_n_heads=4),
    _e("AXK1ForCausalLM", "axk1", **MLA, **{**DS_MOE, "first_k_dense_replace": 0},
       note="all layers MoE: HF has post_mlp_layernorm on MoE layers only, vLLM on every layer"),
    _e("Glm4MoeLiteForCausalLM", "glm4_moe_lite", **MLA, **DS_MOE),
    _e("GlmMoeDsaForCausalLM", "glm_moe_dsa", **MLA, **DS_MOE, index_topk=16, index_head_dim=128, index_n_heads=4),
    _e("MiniCPM3ForCausalLM", "minicpm3", **{k: v for k, v in MLA.items() if k != "num_key_value_heads"},
       num_key_value_heads=HEADS, scale_emb=12, scale_depth=1.4, dim_model_base=64),
    _e("LongcatFlashForCausalLM", "longcat_flash", **MLA, num_layers=2,
       ffn_hidden_size=FFN, moe_topk=TOP_K, n_routed_experts=EXPERTS, zero_expert_num=0,
       expert_ffn_hidden_size=EXPERT_FFN, routed_scaling_factor=1.0,
       mla_scale_q_lora=True, mla_scale_kv_lora=True, zero_expert_type="identity",
       note="no zero (identity) experts: HF 5.19 saves gate/up weights for them, which vLLM rejects"),
    # ---- GLM
    _e("GlmForCausalLM", "glm"),
    _e("Glm4ForCausalLM", "glm4"),
    _e("Glm4MoeForCausalLM", "glm4_moe", n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
       moe_intermediate_size=EXPERT_FFN, first_k_dense_replace=1, use_qk_norm=True, num_nextn_predict_layers=0,
       head_dim=HEAD_DIM),
    # ---- other MoE
    _e("GptOssForCausalLM", "gpt_oss", num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN,
       num_hidden_layers=3, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
       rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                            original_max_position_embeddings=512, rope_theta=150000.0)),
    _e("DbrxForCausalLM", "dbrx", d_model=HIDDEN, n_heads=HEADS, n_layers=2, max_seq_len=MAX_POS,
       attn_config=dict(kv_n_heads=KV_HEADS, clip_qkv=8.0, rope_theta=1e4),
       ffn_config=dict(ffn_hidden_size=EXPERT_FFN, moe_num_experts=EXPERTS, moe_top_k=TOP_K)),
    _e("MiniMaxM2ForCausalLM", "minimax_m2", num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
       intermediate_size=EXPERT_FFN, rotary_dim=HEAD_DIM // 2, scoring_func="sigmoid", use_routing_bias=True),
    _e("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense"),
    _e("HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe", num_experts=EXPERTS, moe_topk=TOP_K, intermediate_size=EXPERT_FFN),
    _e("HYV3ForCausalLM", "hy_v3", num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_shared_experts=1,
       moe_intermediate_size=EXPERT_FFN, router_scaling_factor=1.0, mlp_layer_types=["dense", "sparse"],
       # fields of the original config that vLLM's hy_v3 reads:
       first_k_dense_replace=1, expert_hidden_dim=EXPERT_FFN, route_norm=True, qk_norm=True),
    _e("MellumForCausalLM", "mellum", num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_FFN,
       num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3, mlp_layer_types=["sparse"] * 3),
    _e("LagunaForCausalLM", "laguna", num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_FFN,
       shared_expert_intermediate_size=EXPERT_FFN, num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3,
       num_attention_heads_per_layer=[HEADS] * 3, mlp_layer_types=["dense", "sparse", "sparse"]),
    _e("AfmoeForCausalLM", "afmoe", num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_shared_experts=1,
       moe_intermediate_size=EXPERT_FFN, num_dense_layers=1, num_hidden_layers=3, sliding_window=WINDOW,
       global_attn_every_n_layers=3, layer_types=SWA3, score_func="sigmoid", route_norm=True, n_group=1, topk_group=1),
    _e("MiMoV2FlashForCausalLM", "mimo_v2_flash", n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
       moe_intermediate_size=EXPERT_FFN, v_head_dim=HEAD_DIM, num_hidden_layers=3, sliding_window=WINDOW,
       layer_types=["full_attention", "sliding_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse", "sparse"],
       rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5),
                            sliding_attention=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
       # the fields of the original (remote-code) config that vLLM's mimo_v2 reads:
       hybrid_layer_pattern=[0, 1, 1], moe_layer_freq=[0, 1, 1], swa_num_attention_heads=HEADS,
       swa_num_key_value_heads=2 * KV_HEADS, swa_head_dim=HEAD_DIM, swa_v_head_dim=HEAD_DIM, sliding_window_size=WINDOW,
       add_swa_attention_sink_bias=True, layernorm_epsilon=1e-5, rope_theta=5e6, swa_rope_theta=1e4,
       partial_rotary_factor=0.5),
    # ---- Cohere
    # vLLM's Cohere models always tie lm_head to the embedding (as the real ones do)
    _e("CohereForCausalLM", "cohere", use_qk_norm=False, tie_word_embeddings=True),
    _e("Cohere2ForCausalLM", "cohere2", num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3,
       tie_word_embeddings=True),
    _e("Cohere2MoeForCausalLM", "cohere2_moe", num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3,
       num_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN, mlp_layer_types=["sparse"] * 3,
       tie_word_embeddings=True),
    # ---- others
    _e("Exaone4ForCausalLM", "exaone4", num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3),
    _e("ExaoneMoeForCausalLM", "exaone_moe", num_hidden_layers=3, sliding_window=WINDOW, layer_types=SWA3,
       num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_shared_experts=1, moe_intermediate_size=EXPERT_FFN,
       first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.0),
    _e("Ernie4_5ForCausalLM", "ernie4_5"),
    _e("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", moe_num_experts=EXPERTS, moe_k=TOP_K, moe_intermediate_size=EXPERT_FFN,
       moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=1),
    _e("NemotronForCausalLM", "nemotron"),
    _e("SeedOssForCausalLM", "seed_oss", attention_dropout=0.0, residual_dropout=0.0),
    _e("Jais2ForCausalLM", "jais2"),
]
# multimodal: the language tower with text-only prompts (tests/arch_zoo_mm.py)
_ENTRIES += [
    ZooEntry(arch, mm["model_type"], mm["overrides"], note=mm["note"], sub_configs=mm["sub_configs"], files=mm["files"])
    for arch, mm in MULTIMODAL.items()
]
ZOO: dict[str, ZooEntry] = {e.arch: e for e in _ENTRIES}

# On the GPU (vLLM 0.26), MLA prefill kernels take DeepSeek's own head dimensions only
# (v1/attention/backends/mla/prefill/flash_attn.py: qk_nope 128, qk_rope 64, v 128).
GPU_OVERRIDES: dict[str, dict[str, Any]] = {
    arch: {"qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64}
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
}

# vllm-cpu 0.32 imports its multimodal model files (gemma3_mm, qwen2_5_vl, mistral3, llava, ...)
# at start-up, and they import transformers' image processors, which import torchvision: the CPU
# install leaves torchvision out (scripts/setup.sh: PyPI's wheel is a CUDA build, and with the CPU
# torch it fails at import, "operator torchvision::nms does not exist"). Measured 2026-12-07.
# Gemma 3 runs through vLLM's Transformers backend instead (tests/arch_matrix.py MODEL_IMPL).
_NO_TORCHVISION = (
    "vLLM's own model file does not start, not even for text-only prompts: it imports transformers' image processor, "
    "which needs torchvision, left out of the CPU install since PyPI's wheel is a CUDA build that fails to import "
    "with the CPU torch"
)

# Registry architectures (vLLM 0.32) left out of the zoo, and why.
_HYBRID = "hybrid / recurrent state"
_NO_HF = "no implementation in transformers 5.19"
SKIPPED: dict[str, str] = {
    **{a: _HYBRID for a in (
        "FalconMambaForCausalLM", "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM", "JambaForCausalLM",
        "KimiLinearForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM",
        "NemotronHForCausalLM", "OlmoHybridForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM", "Zamba2ForCausalLM", "InklingForCausalLM",
    )},
    "Qwen4ExpForCausalLM": "hybrid / recurrent state (linear attention) and multimodal config",
    "InklingForConditionalGeneration": "multimodal",
    **{arch: f"multimodal, not in the zoo; {_NO_TORCHVISION} (2026-12-07)" for arch in ("Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration")},
    **{a: _NO_HF for a in (
        "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM", "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM",
        "ChatGLMModel", "ChatGLMForConditionalGeneration", "DeciLMForCausalLM", "DeepseekForCausalLM",
        "ExaoneForCausalLM", "Rnj1ForCausalLM", "Glm5NextForCausalLM", "HCXVisionV2ForCausalLM",
        "InternLM2ForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM", "IQuestLoopCoderForCausalLM",
        "K2HorizonForCausalLM", "LongcatFlashNgramForCausalLM", "MiniCPMForCausalLM", "MiniMaxM3SparseForCausalLM",
        "MistralLarge3ForCausalLM", "MiMoForCausalLM", "MiMoV2ForCausalLM", "NemotronHPuzzleForCausalLM",
        "MuseGlimmerForCausalLM", "OrionForCausalLM", "PanguEmbeddedForCausalLM", "PanguProMoEV2ForCausalLM",
        "PanguUltraMoEForCausalLM", "Param2MoEForCausalLM", "Plamo3ForCausalLM", "SarvamMoEForCausalLM",
        "SarvamMLAForCausalLM", "Step1ForCausalLM", "Step3TextForCausalLM", "Step3p5ForCausalLM",
        "SolarForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM", "TeleFLMForCausalLM",
        "NanbeigeForCausalLM",
    )},
    "ExaoneMoEForCausalLM": "alias of ExaoneMoeForCausalLM",
    "LLaMAForCausalLM": "alias of LlamaForCausalLM",
}

# Measured with vLLM 0.32 (CPU build, 2 cores; LLM(dtype="float32", max_model_len=512,
# enforce_eager=True, seed=0), plugin disabled): 4 greedy tokens vs HF greedy on "the cat reads a book.".
VLLM_CPU_FAILS: dict[str, str] = {
    "DeepseekV32ForCausalLM": "NotImplementedError: Sparse Attention is not supported on CPU",
    "GlmMoeDsaForCausalLM": "NotImplementedError: Sparse Attention is not supported on CPU",
    "LongcatFlashForCausalLM": "CPU build lacks the _moe_C.topk_softmax op",
    "MiniMaxM2ForCausalLM": "CPU MoE router: only softmax scoring without expert groups (sigmoid routing asserts)",
    "LagunaForCausalLM": "CPU MoE router: only softmax scoring without expert groups (sigmoid routing asserts)",
    "DbrxForCausalLM": "vLLM dbrx load_weights: KeyError 'blocks.0.ffn.experts.w13_weight' (fused-MoE parameter naming)",
    "PhiMoEForCausalLM": "loads and runs, but every logit is NaN on CPU (HF is finite)",
    "Qwen2_5_VLForConditionalGeneration": _NO_TORCHVISION + "; nor vLLM's Transformers backend (model_impl='transformers'): "
    "transformers' Qwen2VLVideoProcessor needs torchvision (2026-12-07, 2-core CPU VM)",
}
VLLM_CPU_RUNS: set[str] = set(ZOO) - set(VLLM_CPU_FAILS)
# Runs, but the 4 greedy tokens differ from HF's; HF's top-1/top-2 logit margin is tiny at the
# first differing step, so compare hidden states / logits with a tolerance rather than tokens.
VLLM_CPU_TOKENS_DIFFER: dict[str, str] = {
    "DeepseekV2ForCausalLM": "first token: HF top-2 margin 0.003 (MLA)",
    "DeepseekV3ForCausalLM": "first token: HF top-2 margin 0.003 (MLA)",
    "Glm4MoeLiteForCausalLM": "first token: HF top-2 margin 0.003 (MLA)",
    "AXK1ForCausalLM": "second token: HF top-2 margin 0.076 (MLA); worth a hidden-state check",
    "Cohere2MoeForCausalLM": "fourth token: HF top-2 margin 0.0025",
}


# --------------------------------------------------------------------------- building

def _fingerprint(entry: ZooEntry, config) -> str:
    data = {"zoo": ZOO_VERSION, "config": config.to_dict(), "class": entry.model_class_name, "drop": entry.drop_weights}
    if entry.files:
        data["files"] = entry.files
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_norm(module) -> bool:
    import torch.nn as nn

    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)):
        return True
    return "norm" in type(module).__name__.lower()


def randomize(model, seed: int = 0) -> None:
    """Seeded random weights: >=2-D ~ N(0, 0.08); norm weights 1 + U(-0.5, 0.5) (U(-0.5, 0.5)
    for norms whose weight is an offset from 1, i.e. initialised to 0), norm biases ~ N(0, 0.1);
    other 1-D / scalar parameters: their initial value + N(0, 0.05)."""
    import torch

    torch.manual_seed(seed)
    done: set[int] = set()
    with torch.no_grad():
        for _, module in model.named_modules():
            if not _is_norm(module):
                continue
            for pname, param in module.named_parameters(recurse=False):
                if id(param) in done:
                    continue
                done.add(id(param))
                if pname == "bias":
                    param.normal_(0.0, 0.1)
                else:
                    base = 1.0 if float(param.float().mean()) > 0.5 else 0.0
                    param.uniform_(-0.5, 0.5).add_(base)
        for _, param in model.named_parameters():
            if id(param) in done:
                continue
            done.add(id(param))
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
            else:
                param.add_(torch.randn_like(param) * 0.05)


def _drop_weights(directory: Path, pattern: str) -> None:
    import re

    from safetensors.torch import load_file, save_file

    for file in directory.glob("*.safetensors"):
        tensors = load_file(file)
        kept = {k: v for k, v in tensors.items() if not re.search(pattern, k)}
        if len(kept) != len(tensors):
            save_file(kept, file, metadata={"format": "pt"})


def _root(root: Path | None) -> Path:
    if root is None:
        from lens_evals.models.registry import cache_root

        root = cache_root()
    return Path(root) / "zoo"


def build(arch: str, root: Path | None = None) -> Path:
    """The directory of the tiny ``arch`` model (built once; rebuilt when its config changes)."""
    import torch
    import transformers

    from lens_evals.models.registry import model_path

    entry = ZOO[arch]
    config = entry.config()
    stamp = _fingerprint(entry, config)
    target = _root(root) / arch
    if (target / READY).exists() and (target / READY).read_text().strip() == stamp:
        return target
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tok_dir = model_path(TOKENIZER_SOURCE)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, tmp / name)
    for name, content in entry.files.items():
        merged = json.loads((tmp / name).read_text()) | content if name == "tokenizer_config.json" else content
        (tmp / name).write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    assert vocab == VOCAB, f"tokenizer vocab {vocab} != {VOCAB}"

    model_class = getattr(transformers, entry.model_class_name)
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32).eval()
    randomize(model, seed=0)
    model.config.architectures = [arch]
    model.save_pretrained(tmp, safe_serialization=True)
    # save_pretrained writes the class name; vLLM resolves the registry name (e.g. PhiMoE vs Phimoe)
    saved = json.loads((tmp / "config.json").read_text())
    saved["architectures"] = [arch]
    (tmp / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    if entry.drop_weights:
        _drop_weights(tmp, entry.drop_weights)
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}))
    (tmp / READY).write_text(stamp + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def build_all(root: Path | None = None) -> dict[str, Path]:
    return {arch: build(arch, root) for arch in ZOO}
