"""Paged attention, torch reference (the CPU path and the oracle for GPU kernels).

KV cache of one layer: k_cache and v_cache of shape [num_blocks, block_size, kv_heads, head_dim].
A batch is packed flat: first `num_decode_tokens` sequences with one query token each, then
the other sequences (prefill chunks, speculative verification) back to back. A layer with a
sliding window (window > 0) lets each query see only the `window` latest keys, itself included.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.timing import best_seconds


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner and passed down explicitly to every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    # [num_decodes] int64, context incl. the new token; None when every decode sequence's
    # context is exactly decode_max_seq_len (then nothing needs masking).
    decode_seq_lens: torch.Tensor | None
    decode_max_seq_len: int
    # Other sequences: (query start, query length, context length incl. the queries).
    prefill_seqs: list[tuple[int, int, int]]
    # One [num_blocks] int64 row per prefill sequence: a padded 2-d tensor, or a list.
    prefill_block_tables: torch.Tensor | list[torch.Tensor]
    # decode_attention_mask(decode_seq_lens, decode_max_seq_len), built once per step rather
    # than once per layer; built on the fly when None.
    decode_attn_mask: torch.Tensor | None = None
    # The decode rows cut into groups of similar context length (plan_decode_groups), each
    # attended on its own: then only a group's longest context sets its padding, not the
    # batch's. None: one group, described by the decode_* fields above.
    decode_groups: list[DecodeGroup] | None = None
    # Decode rows through torch.ops.splitserve_cpu.paged_decode_attention (kernels/cpu), which
    # reads the paged cache in place; needs decode_seq_lens.
    native_decode: bool = False
    # Prefill rows through torch.ops.splitserve_cpu.prefill_attention (kernels/cpu): bfloat16
    # on a CPU with AVX-512 BF16, head_dim a multiple of 16 (ModelRunner decides once).
    native_prefill: bool = False
    # ATTENTION_BACKENDS: "triton" runs kernels/triton (decode and prefill rows reading the
    # paged cache in place); "torch" this module; "auto": triton on CUDA when it imports.
    attention_backend: str = "auto"
    # prefill_seqs as a [3, sequences] int tensor on the device (starts, query lengths, context
    # lengths), for the Triton prefill kernel; None: it builds its own.
    prefill_seq_info: torch.Tensor | None = None
    # With native_prefill: the prefill sequences with nothing cached before them (context
    # length = query length) as an int64 [n, 2] tensor of (query start, length), attended in
    # one call per layer (prefill_attention_into) instead of one per sequence; None: none.
    fresh_prefill_spans: torch.Tensor | None = None
    # With native_prefill on AMX: the prefill sequences after a cached prefix as an int64
    # [n, 4] tensor of (query start, length, context length, row of prefill_block_tables),
    # attended in one call per layer reading the paged cache (prefill_attention_paged), each
    # block they share packed once; None: none (or one per sequence, gathered, as before).
    cached_prefill_spans: torch.Tensor | None = None
    # With native_decode: decode rows behind a shared prefix (find_shared_prefixes), as the C++
    # kernel takes them: each row's prefix (-1: none) [num_decodes] and each prefix's length in
    # tokens [prefixes], int64; None: no prefix is shared.
    decode_shared_prefix_of: torch.Tensor | None = None
    decode_shared_prefix_lens: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start, end) of the batch and their attention inputs."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, blocks of the longest context] int64
    seq_lens: torch.Tensor | None  # None when every context is max_seq_len long
    max_seq_len: int
    attn_mask: torch.Tensor | None  # decode_attention_mask(seq_lens, max_seq_len)


# A group closes when the next context is this much shorter than the group's longest and the
# group has MIN_GROUP_ROWS rows: padding then wastes at most ~25% of a group's attention,
# against ~45% for one group on a batch of prompts of 128 to 512 tokens.
GROUP_LENGTH_RATIO = 0.75
MIN_GROUP_ROWS = 4


def plan_decode_groups(
    seq_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> list[DecodeGroup]:
    """Cut decode rows, sorted by decreasing context length, into groups (see above)."""
    groups = []
    start = 0
    while start < len(seq_lens):
        longest = seq_lens[start]
        end = start + 1
        while end < len(seq_lens) and (
            end - start < MIN_GROUP_ROWS or seq_lens[end] > GROUP_LENGTH_RATIO * longest
        ):
            end += 1
        width = -(-longest // block_size)
        tables = torch.tensor(
            [t[:width] + [0] * (width - len(t[:width])) for t in block_tables[start:end]],
            dtype=torch.long, device=device,
        )
        lens = mask = None
        if seq_lens[end - 1] < longest:
            lens = torch.tensor(seq_lens[start:end], dtype=torch.long, device=device)
            mask = decode_attention_mask(lens, longest)
        groups.append(DecodeGroup(start, end, tables, lens, longest, mask))
        start = end
    return groups


# A prefix shared by fewer tokens than this is read per row: its task would cost more to set
# up than the reads it saves.
MIN_SHARED_PREFIX_TOKENS = 64


def find_shared_prefixes(
    block_tables: list[list[int]], seq_lens: list[int], block_size: int
) -> tuple[list[int], list[int]] | None:
    """Decode rows whose block tables begin with the same blocks (a system prompt or document
    in the prefix cache): per row the prefix it is behind (-1: none), per prefix its length in
    tokens (whole blocks every row of it holds, at least MIN_SHARED_PREFIX_TOKENS); None when
    no prefix is shared by two rows. Rows are grouped by their first block and a group's prefix
    is what all of its rows hold, so two conversations under one system prompt share the
    system prompt."""
    by_first: dict[int, list[int]] = {}
    for row, table in enumerate(block_tables):
        if seq_lens[row] >= MIN_SHARED_PREFIX_TOKENS and table:
            by_first.setdefault(table[0], []).append(row)
    prefix_of = [-1] * len(seq_lens)
    prefix_lens: list[int] = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        full = min(seq_lens[r] for r in rows) // block_size  # blocks each row has filled
        tables = [block_tables[r][:full] for r in rows]
        low, high = min(tables), max(tables)  # the common prefix of all is theirs
        blocks = next((i for i, (a, b) in enumerate(zip(low, high, strict=False)) if a != b), len(low))
        if blocks * block_size < MIN_SHARED_PREFIX_TOKENS:
            continue
        for r in rows:
            prefix_of[r] = len(prefix_lens)
        prefix_lens.append(blocks * block_size)
    return (prefix_of, prefix_lens) if prefix_lens else None


ATTENTION_BACKENDS = ("auto", "torch", "triton")


def uses_triton(backend: str, device: torch.device) -> bool:
    """Whether a step on `device` with this attention backend runs the Triton kernels."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (choose auto, torch or triton)")
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention backend triton needs a CUDA device, not {device.type} "
                             "(on CPU only under TRITON_INTERPRET=1, the tests' interpreter)")
        return True
    return backend == "auto" and device.type == "cuda" and triton_available()


@functools.cache
def triton_available() -> bool:
    try:
        import kernels.triton.paged_attention  # noqa: F401
    except ImportError:
        return False
    return True


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V ([tokens, kv_heads, head_dim]) into their cache slots."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] for any shape of block_ids, as one index_select of whole blocks
    (a row copy each; advanced indexing of the 4-d cache is several times slower on CPU)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape, *cache.shape[1:])


def decode_attention_mask(
    seq_lens: torch.Tensor, max_seq_len: int, window: int = 0
) -> torch.Tensor:
    """[B, 1, 1, max_seq_len] bool: the cached positions each decode sequence may read (with a
    window, only the last `window` of its context)."""
    positions = torch.arange(max_seq_len, device=seq_lens.device)
    mask = positions[None, :] < seq_lens[:, None]
    if window:
        mask &= positions[None, :] >= seq_lens[:, None] - window
    return mask.view(-1, 1, 1, max_seq_len)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | None,
    max_seq_len: int,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence. query: [B, heads, head_dim] -> [B, heads, head_dim].

    Query heads that share a KV head are folded into the query-length axis, so grouped-query
    attention needs no copy of K/V per query head. seq_lens None: every context is
    max_seq_len long; attn_mask: decode_attention_mask(seq_lens, max_seq_len) if precomputed
    (ignored when a window shorter than max_seq_len needs a mask of its own)."""
    batch, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    block_size = k_cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks]
    # [B, blocks, block_size, kv_heads, D] -> [B, kv_heads, L, D] (a strided view: SDPA reads it
    # as is, so the gather is the only copy of the context).
    keys = gather_blocks(k_cache, tables).flatten(1, 2)[:, :max_seq_len].transpose(1, 2)
    values = gather_blocks(v_cache, tables).flatten(1, 2)[:, :max_seq_len].transpose(1, 2)
    q = query.view(batch, kv_heads, group, head_dim)
    if window and max_seq_len > window:
        if seq_lens is None:
            seq_lens = torch.full((batch,), max_seq_len, dtype=torch.long, device=query.device)
        attn_mask = decode_attention_mask(seq_lens, max_seq_len, window)
    elif attn_mask is None and seq_lens is not None:
        attn_mask = decode_attention_mask(seq_lens, max_seq_len)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of the last `q_len` positions over `ctx_len` keys (with a window, over
    the `window` keys up to each query's own).
    query: [q_len, heads, D]; key/value: [ctx_len, kv_heads, D] -> [q_len, heads, D]."""
    q_len, num_heads, head_dim = query.shape
    ctx_len, kv_heads = key.shape[0], key.shape[1]
    group = num_heads // kv_heads
    # 4-d [kv_heads, group, len, D] with K/V broadcast (stride 0) over the group: the CPU
    # flash kernel takes that, while 3-d or enable_gqa inputs fall back to the math path,
    # which is about 2.5x slower.
    q = query.transpose(0, 1).view(kv_heads, group, q_len, head_dim)
    k = key.transpose(0, 1).unsqueeze(1).expand(kv_heads, group, ctx_len, head_dim)
    v = value.transpose(0, 1).unsqueeze(1).expand(kv_heads, group, ctx_len, head_dim)
    sliding = bool(window) and ctx_len > window
    if q_len == ctx_len and not sliding:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Query i sits at absolute position ctx_len - q_len + i and sees keys up to it.
        rows = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        keys = torch.arange(ctx_len, device=query.device)[None, :]
        mask = keys <= rows[:, None]
        if sliding:
            mask &= keys > rows[:, None] - window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_heads, q_len, head_dim).transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    stored: bool = False,
) -> torch.Tensor:
    """Store this step's K/V (unless the caller has: `stored`), then attend every query over its
    sequence's cached context (the last `window` keys of it when window > 0).
    query: [tokens, heads, D]; key/value: [tokens, kv_heads, D] -> [tokens, heads, D]."""
    if not stored:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    if uses_triton(meta.attention_backend, query.device):
        from kernels.triton.paged_attention import triton_paged_attention  # needs triton

        return triton_paged_attention(
            query, k_cache, v_cache, meta.num_decode_tokens, meta.decode_block_tables,
            meta.decode_seq_lens, meta.decode_max_seq_len, meta.prefill_seqs,
            meta.prefill_block_tables, scale, window, meta.prefill_seq_info,
        )
    num_decode = meta.num_decode_tokens
    groups = meta.decode_groups
    if not meta.prefill_seqs and (groups is None or len(groups) == 1):
        return _attend_decode(query, k_cache, v_cache, groups[0] if groups else meta, scale, window)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for group in groups or ([meta] if num_decode else []):
        start, end = (group.start, group.end) if groups else (0, num_decode)
        out[start:end] = _attend_decode(query[start:end], k_cache, v_cache, group, scale, window)
    fresh = meta.fresh_prefill_spans
    if fresh is not None:
        torch.ops.splitserve_cpu.prefill_attention_into(out, query, key, value, fresh, scale, window)
    cached = meta.cached_prefill_spans if not window else None  # the paged call has no window
    if cached is not None:
        torch.ops.splitserve_cpu.prefill_attention_paged(out, query, k_cache, v_cache, cached,
                                                         meta.prefill_block_tables, scale)
    for (start, q_len, ctx_len), table in zip(meta.prefill_seqs, meta.prefill_block_tables, strict=True):
        if (fresh is not None and ctx_len == q_len) or (cached is not None and ctx_len > q_len):
            continue  # attended above
        end = start + q_len
        if ctx_len == q_len:
            k, v = key[start:end], value[start:end]
        else:  # cached prefix: read the whole context back from the paged cache
            num_blocks = -(-ctx_len // k_cache.shape[1])
            k = gather_blocks(k_cache, table[:num_blocks]).flatten(0, 1)[:ctx_len]
            v = gather_blocks(v_cache, table[:num_blocks]).flatten(0, 1)[:ctx_len]
        if meta.native_prefill:
            out[start:end] = torch.ops.splitserve_cpu.prefill_attention(query[start:end], k, v,
                                                                         scale, window)
        else:
            out[start:end] = prefill_attention(query[start:end], k, v, scale, window)
    return out


def _attend_decode(query, k_cache, v_cache, group: DecodeGroup | AttentionMetadata, scale, window):
    """paged_decode_attention over one decode group, or over all decode rows of `meta`."""
    if isinstance(group, AttentionMetadata) and group.native_decode:
        return torch.ops.splitserve_cpu.paged_decode_attention(
            query, k_cache, v_cache, group.decode_block_tables, group.decode_seq_lens, scale, window,
            group.decode_shared_prefix_of, group.decode_shared_prefix_lens,
        )
    if isinstance(group, DecodeGroup):
        return paged_decode_attention(
            query, k_cache, v_cache, group.block_tables, group.seq_lens, group.max_seq_len,
            scale, group.attn_mask, window,
        )
    return paged_decode_attention(
        query, k_cache, v_cache, group.decode_block_tables, group.decode_seq_lens,
        group.decode_max_seq_len, scale, group.decode_attn_mask, window,
    )


@dataclass(frozen=True)
class PrefillCalibration:
    """Whether the C++ prefill attention beat torch's SDPA here, on what was timed: seconds of
    each over one prompt's chunks (the best of the passes)."""

    native: bool
    cpp_s: float
    torch_s: float

    def describe(self) -> str:
        return (f"prefill attention {'cpp' if self.native else 'torch SDPA'} (one layer of a "
                f"prompt in chunks: cpp {self.cpp_s * 1e3:.1f} vs torch {self.torch_s * 1e3:.1f} "
                "ms)")


def calibrate_prefill_attention(heads: int, kv_heads: int, head_dim: int, chunk: int,
                                chunks: int = 4, repeats: int = 1,
                                margin: float = 0.9) -> PrefillCalibration:
    """Times the C++ prefill attention (torch.ops.splitserve_cpu.prefill_attention, bf16) and
    prefill_attention (torch's SDPA) on one layer of a prompt of `chunks` chunks of `chunk`
    tokens, each chunk attending over the prompt so far (the first causally over itself), as
    a chunked prefill runs them; the best of `repeats` passes after a warm-up. The C++ kernel
    is kept unless it takes more than `margin` of SDPA's time: its AVX-512 BF16 dot products
    beat torch's flash kernel by 3-5x on one host and took more than twice its time on another,
    where its AMX path (where the CPU has AMX) took 0.6x SDPA's."""
    generator = torch.Generator().manual_seed(0)
    length = chunk * chunks
    q = torch.randn(length, heads, head_dim, generator=generator).bfloat16()
    k = torch.randn(length, kv_heads, head_dim, generator=generator).bfloat16()
    v = torch.randn(length, kv_heads, head_dim, generator=generator).bfloat16()
    scale = head_dim ** -0.5

    def chunks_through(attend) -> None:
        for end in range(chunk, length + 1, chunk):
            attend(q[end - chunk : end], k[:end], v[:end], scale, 0)

    best = best_seconds({
        "cpp": lambda: chunks_through(torch.ops.splitserve_cpu.prefill_attention),
        "torch": lambda: chunks_through(prefill_attention),
    }, repeats)
    return PrefillCalibration(best["cpp"] <= margin * best["torch"], best["cpp"], best["torch"])
