"""The Llama family (Llama, Llama 3 rope scaling, Mistral, Qwen2 with qkv bias, SmolLM):
RMSNorm, RoPE, grouped-query attention over the paged cache, SwiGLU, optional tied embeddings."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import silu_and_mul
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from kernels.attention import AttentionMetadata, paged_attention, uses_triton


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
            bias=config.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size)
        self.rotary = rotary
        self.scale = config.head_dim**-0.5
        self.window = config.window_of(layer)  # 0: full causal attention
        self.native = False  # the C++ rotary + cache write for bfloat16 on the CPU (use_fused_decode)

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """cos_sin: this step's rotary angles (RotaryEmbedding.cos_sin of the positions)."""
        qkv = self.qkv_proj(hidden)
        if self.native and qkv.dtype == torch.bfloat16 and not qkv.is_cuda:
            # Rotary embedding and cache write in one C++ pass (use_fused_decode).
            cos, sin = (t.squeeze(1) for t in cos_sin)
            q, k, v = torch.ops.splitserve_cpu.rotate_and_store_split(
                qkv, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads)
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window,
                                  stored=True)
            return self.o_proj(out.flatten(1))
        num_qk_heads = self.num_heads + self.num_kv_heads
        if uses_triton(meta.attention_backend, qkv.device):
            # Rotary embedding and cache write in one kernel; a slot of -1 (a CUDA graph's
            # padding row) stores nothing. The attention kernels then read K/V from the cache.
            from kernels.triton.rotary_kv import triton_rotary_kv  # needs triton

            q, k, v = qkv.view(-1, num_qk_heads + self.num_kv_heads, self.head_dim).split(
                [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            q = triton_rotary_kv(q, k, v, *cos_sin, kv_cache[0], kv_cache[1], meta.slot_mapping)
            # k is unrotated here, and unused: paged_attention's Triton path reads the cache.
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                  self.window, stored=True)
            return self.o_proj(out.flatten(1))
        # Q and K lie side by side in qkv, so one rotation covers both.
        qk = qkv[:, : num_qk_heads * self.head_dim].view(-1, num_qk_heads, self.head_dim)
        q, k = self.rotary.rotate(qk, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, num_qk_heads * self.head_dim :].view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size])
        self.down_proj = RowParallelLinear(size, config.hidden_size)
        self.native = False  # the C++ silu_and_mul for bfloat16 rows on the CPU (use_fused_decode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2:
            return self.down_proj(torch.ops.splitserve_cpu.silu_and_mul_step(gate_up))
        return self.down_proj(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, cos_sin, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, backend=meta.attention_backend)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, meta.attention_backend)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, meta.attention_backend)
        return self.mlp(hidden), residual


@dataclass
class _FusedDecode:
    """What torch.ops.splitserve_cpu.decode_layers takes besides the step's inputs: the
    parameters of every layer, listed once (see LlamaForCausalLM.use_fused_decode)."""

    input_norm: list[torch.Tensor]
    qkv_weight: list[torch.Tensor]
    qkv_bias: list[torch.Tensor]  # empty: no qkv bias
    o_weight: list[torch.Tensor]
    post_norm: list[torch.Tensor]
    gate_up_weight: list[torch.Tensor]
    down_weight: list[torch.Tensor]
    final_norm: torch.Tensor
    windows: list[int]  # per layer, 0: full attention
    heads: int
    kv_heads: int
    eps: float
    scale: float
    small_m_max_rows: int
    packed: list[torch.Tensor]  # qkv, o, gate_up, down of each layer, packed; empty: none
    caches_of: list[torch.Tensor] | None = None
    k_caches: list[torch.Tensor] = field(default_factory=list)
    v_caches: list[torch.Tensor] = field(default_factory=list)


def _packed_weights(layers) -> list[torch.Tensor]:
    """Each layer's qkv, o, gate_up and down weights packed (use_packed_weights), in that
    order; empty when the layers hold no packed copies."""
    projections = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj) for layer in layers]
    packed = [p.packed_weight for group in projections for p in group]
    return packed if all(p is not None for p in packed) else []


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    STACKED = (
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._fused: _FusedDecode | None = None  # see use_fused_decode
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)  # once, not once per layer
        if self._fused is not None and meta.native_decode and meta.num_decode_tokens == len(hidden):
            return self._decode_layers(hidden, cos_sin, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=False):
            hidden, residual = layer(cos_sin, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual, meta.attention_backend)
        return hidden

    def use_fused_decode(self, small_m_max_rows: int) -> None:
        """Run steps of decode rows only through torch.ops.splitserve_cpu.decode_layers (all
        layers in one C++ call; CPU, bfloat16, one rank: the model runner checks). Linear
        layers of at most `small_m_max_rows` rows take the small-M kernel there too, and more
        rows the weights packed (AMX tiles or oneDNN) when the layers have them (use_packed_weights). Other
        steps (prefill chunks, mixed) keep the per-layer modules, with the same kernel's RMS
        norm and SwiGLU: 0.23 against 0.56 ms and 0.63 against 1.03 ms at 2,048 rows."""
        layers = self.layers
        for layer in layers:
            layer.input_layernorm.native = layer.post_attention_layernorm.native = True
            layer.mlp.native = layer.self_attn.native = True
        self.norm.native = True
        attn = layers[0].self_attn
        self._fused = _FusedDecode(
            input_norm=[layer.input_layernorm.weight for layer in layers],
            qkv_weight=[layer.self_attn.qkv_proj.weight for layer in layers],
            qkv_bias=[layer.self_attn.qkv_proj.bias for layer in layers] if attn.qkv_proj.bias is not None else [],
            o_weight=[layer.self_attn.o_proj.weight for layer in layers],
            post_norm=[layer.post_attention_layernorm.weight for layer in layers],
            gate_up_weight=[layer.mlp.gate_up_proj.weight for layer in layers],
            down_weight=[layer.mlp.down_proj.weight for layer in layers],
            final_norm=self.norm.weight,
            windows=[layer.self_attn.window for layer in layers],
            heads=attn.num_heads, kv_heads=attn.num_kv_heads, eps=self.norm.eps, scale=attn.scale,
            small_m_max_rows=small_m_max_rows,
            packed=_packed_weights(layers),
        )

    def _decode_layers(self, hidden, cos_sin, kv_caches, meta) -> torch.Tensor:
        f = self._fused
        if f.caches_of is not kv_caches:  # split once per cache list, not once per step
            f.caches_of = kv_caches
            f.k_caches = [kv[0] for kv in kv_caches]
            f.v_caches = [kv[1] for kv in kv_caches]
        cos, sin = (t.squeeze(1) for t in cos_sin)
        return torch.ops.splitserve_cpu.decode_layers(
            hidden, cos, sin, f.input_norm, f.qkv_weight, f.qkv_bias, f.o_weight, f.post_norm,
            f.gate_up_weight, f.down_weight, f.final_norm, f.k_caches, f.v_caches,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
            f.heads, f.kv_heads, f.eps, f.scale, f.small_m_max_rows, f.packed, f.windows,
            meta.decode_shared_prefix_of, meta.decode_shared_prefix_lens,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; returns the parameters that were loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard_id = None
            for ckpt, ours, sid in self.STACKED:
                if ckpt in name:
                    name, shard_id = name.replace(ckpt, ours), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
        return loaded
