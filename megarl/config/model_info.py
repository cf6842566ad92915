"""The model's own architecture, read from its HF ``config.json``, for layout validation and size
estimates. Only the JSON is read (no transformers import), so this is fast and works for model
types the installed transformers does not know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF config keys that hold the same quantity under different names, in lookup order.
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "experts_per_token", "num_experts_per_token")
MOE_FFN_KEYS = ("moe_intermediate_size", "expert_intermediate_size")
KV_HEADS_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
LAYERS_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
HEADS_KEYS = ("num_attention_heads", "n_head")
MAX_POS_KEYS = ("max_position_embeddings", "seq_length", "max_sequence_length")

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Checkpoint files of an HF model directory; a directory with config.json only is a model card.
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class ModelInfoError(ValueError):
    """config.json is missing, unreadable or lacks a required field; the message is one line."""


@dataclass(frozen=True)
class ModelInfo:
    """Architecture facts of an HF decoder model that the parallel layout depends on."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_hidden_size: int
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_hidden_size: int = 0
    num_shared_experts: int = 0
    shared_expert_ffn_hidden_size: int = 0
    dense_layers: tuple[int, ...] = ()
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts."""
        return self.num_experts > 0

    @property
    def first_dense_layers(self) -> int:
        """How many leading layers use a dense MLP instead of experts."""
        count = 0
        while count in self.dense_layers:
            count += 1
        return count

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V2/V3: a compressed KV)."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        """How many layers hold routed experts."""
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    def attention_params(self) -> int:
        """Weights of one attention block (GQA: q, k, v, o; MLA: down/up projections and o)."""
        h, heads = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            return h * self.head_dim * (2 * heads + 2 * self.num_kv_heads)
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (h * self.q_lora_rank + self.q_lora_rank * heads * qk_dim if self.q_lora_rank
             else h * heads * qk_dim)
        kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + heads * self.v_head_dim * h

    def embedding_params(self) -> int:
        """Input embedding plus the output layer (one matrix when they are tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def expert_params(self) -> int:
        """Weights of one routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def moe_layer_shared_params(self) -> int:
        """Weights of a MoE layer that every token uses: router and shared experts."""
        h = self.hidden_size
        return h * self.num_experts + 3 * h * self.shared_expert_ffn_hidden_size

    def param_count(self) -> int:
        """Parameters of the main model (embeddings, attention, MLP/experts; norms ignored)."""
        return self._count(self.num_experts)

    def active_param_count(self) -> int:
        """Parameters one token passes through: as :meth:`param_count` with top_k routed experts."""
        return self._count(self.top_k)

    def _count(self, experts_per_layer: int) -> int:
        """Embeddings + attention + dense MLPs + MoE layers with ``experts_per_layer`` experts."""
        n_dense = len(self.dense_layers)
        dense_mlp = 3 * self.hidden_size * self.ffn_hidden_size
        moe_mlp = (experts_per_layer * self.expert_params() + self.moe_layer_shared_params()
                   if self.is_moe else 0)
        return (self.embedding_params() + self.num_layers * self.attention_params()
                + n_dense * dense_mlp + self.moe_layers * moe_mlp)

    def fp8_params(self, attention: bool = True) -> int:
        """Parameters a block-FP8 checkpoint stores in FP8: every projection of attention
        (unless ``attention`` is false: ``rollout.fp8_attention``), MLPs, routed and shared
        experts; not the embeddings, the output layer or the routers."""
        kept = 0 if attention else self.num_layers * self.attention_params()
        return (self.param_count() - self.embedding_params()
                - self.moe_layers * self.hidden_size * self.num_experts - kept)

    def weight_bytes(self, dtype: str, quantization: str | None = None,
                     fp8_attention: bool = True) -> float:
        """Bytes of one whole copy of the weights: ``dtype``, or with ``quantization="fp8"``
        every projection (the attention's only with ``fp8_attention``) in e4m3 with an fp32
        scale per 128x128 block and the rest in ``dtype``."""
        total = self.param_count()
        if quantization != "fp8":
            return total * DTYPE_BYTES[dtype]
        fp8 = self.fp8_params(fp8_attention)
        return fp8 * (1 + 4 / (128 * 128)) + (total - fp8) * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str, tp: int = 1) -> int:
        """KV-cache bytes one token takes on one GPU of an engine with tensor parallel ``tp``."""
        nbytes = DTYPE_BYTES[dtype]
        if self.is_mla:  # MLA caches one latent per layer, replicated over TP
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * nbytes
        kv_heads_per_gpu = max(1, self.num_kv_heads // tp)
        return 2 * self.num_layers * kv_heads_per_gpu * self.head_dim * nbytes


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    """The value of the first of ``keys`` present (and not null) in ``cfg``."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _dense_layers(cfg: dict[str, Any], num_layers: int, num_experts: int) -> tuple[int, ...]:
    """Indices of layers with a dense MLP, from any of the HF conventions for it."""
    if not num_experts:
        return tuple(range(num_layers))
    dense = set(cfg.get("mlp_only_layers") or [])
    first_k = cfg.get("first_k_dense_replace") or 0
    dense.update(range(min(first_k, num_layers)))
    sparse_step = cfg.get("decoder_sparse_step") or 1  # Qwen: i is sparse if (i+1) % step == 0
    if isinstance(sparse_step, int) and sparse_step > 1:
        dense.update(i for i in range(num_layers) if (i + 1) % sparse_step != 0)
    layer_freq = cfg.get("moe_layer_freq") or 1  # DeepSeek: layer i is sparse if i % freq == 0
    if isinstance(layer_freq, int) and layer_freq > 1:
        dense.update(i for i in range(num_layers) if i % layer_freq != 0)
    return tuple(sorted(dense))


def model_info_from_dict(cfg: dict[str, Any], source: str = "config.json") -> ModelInfo:
    """Build a :class:`ModelInfo` from an HF config dict (multimodal ones via ``text_config``)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    missing = [name for name, keys in (("num_hidden_layers", LAYERS_KEYS),
                                        ("hidden_size", ("hidden_size", "n_embd")),
                                        ("num_attention_heads", HEADS_KEYS),
                                        ("vocab_size", ("vocab_size",)))
               if _first(cfg, keys) is None]
    if missing:
        raise ModelInfoError(f"{source} has no {', '.join(missing)} — is this an HF decoder "
                             f"model config?")
    hidden = int(_first(cfg, ("hidden_size", "n_embd")))
    heads = int(_first(cfg, HEADS_KEYS))
    num_layers = int(_first(cfg, LAYERS_KEYS))
    num_experts = int(_first(cfg, NUM_EXPERTS_KEYS, 0) or 0)
    ffn = int(cfg.get("intermediate_size") or 4 * hidden)
    shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0)
    n_shared = int(cfg.get("n_shared_experts") or (1 if shared_ffn else 0))
    moe_ffn = int(_first(cfg, MOE_FFN_KEYS, 0) or (ffn if num_experts else 0))
    if n_shared and not shared_ffn:
        shared_ffn = n_shared * moe_ffn
    return ModelInfo(
        model_type=str(cfg.get("model_type", "unknown")),
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(_first(cfg, KV_HEADS_KEYS, heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        ffn_hidden_size=ffn,
        max_position_embeddings=_first(cfg, MAX_POS_KEYS),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=num_experts,
        top_k=int(_first(cfg, TOP_K_KEYS, 0) or 0) if num_experts else 0,
        moe_ffn_hidden_size=moe_ffn,
        num_shared_experts=n_shared,
        shared_expert_ffn_hidden_size=shared_ffn,
        dense_layers=_dense_layers(cfg, num_layers, num_experts),
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
    )


def load_model_info(path: str | Path) -> ModelInfo:
    """Read ``path/config.json``; raise :class:`ModelInfoError` with one clear line on failure."""
    path = Path(path)
    config_file = path / "config.json"
    if not path.exists():
        raise ModelInfoError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelInfoError(f"{path} is a file, not an HF model directory")
    if not config_file.is_file():
        raise ModelInfoError(f"{path} has no config.json — is it an HF model directory?")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelInfoError(f"{config_file} cannot be read: {err}") from err
    if not isinstance(cfg, dict):
        raise ModelInfoError(f"{config_file} does not hold a JSON object")
    return model_info_from_dict(cfg, source=str(config_file))


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint files (safetensors / PyTorch bins) directly in ``path``; [] for a model card.

    Validation and the estimates read config.json only, so a card (config.json alone) is enough
    for them; loading the model for training or serving needs these files.
    """
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted(f for pattern in WEIGHT_PATTERNS for f in path.glob(pattern))


def tokenizer_size(path: str | Path) -> int | None:
    """One more than the largest token id in ``path/tokenizer.json``; None when not readable."""
    tok_file = Path(path) / "tokenizer.json"
    try:
        tok = json.loads(tok_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    vocab = (tok.get("model") or {}).get("vocab")
    ids: list[int] = [t["id"] for t in tok.get("added_tokens") or [] if "id" in t]
    if isinstance(vocab, dict):
        ids.extend(int(i) for i in vocab.values())
    elif isinstance(vocab, list):  # Unigram: a list of [piece, score]; ids are positions
        ids.append(len(vocab) - 1)
    return max(ids) + 1 if ids else None
