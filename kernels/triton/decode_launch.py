"""Launcher of the short-query forward (`flash_decode.py`): a plan per call signature, as
`forward.ForwardPlan`, for the calls `dmattn_bench.plan` sends it: few query rows
(`space.MAX_DECODE_QUERIES`), no gradient.

One launch when the keys take one split (the kernel writes out and lse), else the split kernel
into fp32 partials and `decode_combine_kernel`; before them, on a long cache under a padding mask,
`decode_mask_span_kernel` (the splits then cut the span the mask keeps).

A sliding window (`window=(left, right)`, FlashAttention's `window_size`) is the kernel's
HAS_WINDOW: its splits cut the keys the window spans rather than the cache, so the split count
follows the window's key tiles. The span pass reads a padding mask over the whole cache, so it runs
only where the window leaves the left side unbounded (then the rows' windows together span every
key of the sequence, as without one); under a left bound the window is the span the splits cut,
and each split scans only its part of it.
"""

from __future__ import annotations

import torch
import triton

from dmattn_kernels.configs import MAX_SPLITS, DecodeConfig, window_bounds
from dmattn_kernels.runtime import launch_context, native
from dmattn_kernels.runtime.launch_context import launch_stream
from dmattn_kernels.runtime.operands import broadcast_layout, contiguous_strides
from dmattn_kernels.triton.flash_decode import decode_combine_kernel, decode_mask_span_kernel, flash_decode_kernel
from dmattn_kernels.triton.launching import Launch, Workspace
from dmattn_kernels.triton.layouts import head_block

MIN_BLOCK_M, MAX_BLOCK_M = 16, 64  # packed rows per program: tl.dot's minimum, and a tile that stays in registers
# The split count when a config leaves it to the plan: SPLIT_WAVES programs per SM, at most
# AUTO_MAX_SPLITS ranges. With a padding mask (a mask shared by a program's rows) programs whose
# ranges hold no kept key finish early, so many short ranges let the others share the GPU evenly
# (MASKED_*; past 16 splits the partials' traffic and the combine cost more than the balance
# gains). Without one every range is full: more splits than two waves only add partials (H100,
# B64 Lk2k-4k without a mask, 3 splits against 1: 5-10% slower). A tunable (`num_splits`).
SPLIT_WAVES, AUTO_MAX_SPLITS = 2, 64
MASKED_SPLIT_WAVES, MASKED_AUTO_MAX_SPLITS = 8, 16
# keys of a padding mask a program scans per step for the span it keeps (`flash_decode.py`): a
# vector of this many flags per program, few steps over a split's range
MASK_SCAN_KEYS = 1024
# From this cache length on, a padding mask's kept span is found by a pass of its own before the
# split kernel, and the splits cut the span rather than the cache (then as balanced as with
# cache_seqlens, so SPLIT_WAVES): a short window of a long cache would otherwise fall to the few
# splits whose ranges hold it. H100, bf16, B8 Lk32k holding 4k keys (`dmattn-bench bench
# --workloads configs/workloads/peers-decode.yaml`, D11, 2026-11-26): 0.078 -> 0.057 ms with the
# pass, 0.053 with cache_seqlens; B64 Lk16k fully kept but for the tail: 1.293 -> 1.323 ms (the
# pass reads every flag). Below it a step is short (B1: 13-20 us) and the extra launch would
# cost more than the balance gains. MASK_SPAN_CHUNK: mask flags per program of the span pass.
MASK_SPAN_MIN_KEYS = 16384
MASK_SPAN_CHUNK = 2048
SPAN_NUM_WARPS = 4
COMBINE_NUM_WARPS = 4


def split_count(programs: int, key_tiles: int, num_sms: int, padding_mask: bool = False) -> int:
    """Splits of the key range for `programs` programs per split on `num_sms` SMs: enough for
    SPLIT_WAVES programs per SM (MASKED_SPLIT_WAVES under a padding mask), at most one per key
    tile and AUTO_MAX_SPLITS (MASKED_AUTO_MAX_SPLITS)."""
    waves, most = (MASKED_SPLIT_WAVES, MASKED_AUTO_MAX_SPLITS) if padding_mask else (SPLIT_WAVES, AUTO_MAX_SPLITS)
    return max(1, min(triton.cdiv(waves * num_sms, programs), key_tiles, most))


def page_tile(block_n: int, page_size: int) -> int:
    """The key tile a paged cache runs: `block_n`, or the largest power of two dividing the page
    when that is smaller (a tile never straddles two pages)."""
    return min(block_n, page_size & -page_size)


class DecodePlan:
    """A short-query forward for one signature; `plan(q, k, v, mask, bias, seqlens, block_table,
    out, lse)` runs it. `num_sms`: the GPU's SM count (splits chosen for it when the config leaves
    them to the plan). With a `block_table`, k and v are a paged cache (`flash_decode.py`). The
    mask and bias come as the caller passed them (up to 4 dims, as `forward.ForwardPlan`'s).
    `window`: (left, right), FlashAttention's `window_size` (inclusive, bottom-right aligned per
    sequence, -1 = unbounded side), ANDed with the causal rule and the mask."""

    def __init__(self, q, k, v, mask, bias, seqlens, block_table, *, is_causal: bool, softmax_scale: float,
                 softcap: float, config: DecodeConfig, out: torch.Tensor, lse: torch.Tensor, num_sms: int,
                 window: tuple[int, int] = (-1, -1)):
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
        block_n, page_size = config.block_n, 0
        if block_table is not None:
            page_size = k.shape[1]
            seqlen_k, block_n = block_table.shape[1] * page_size, page_tile(config.block_n, page_size)
        group = num_heads // num_heads_kv
        block_d = head_block(head_dim)
        rows = seqlen_q * group
        block_m = min(max(MIN_BLOCK_M, triton.next_power_of_2(rows)), MAX_BLOCK_M)
        row_blocks = triton.cdiv(rows, block_m)
        key_tiles = triton.cdiv(seqlen_k, block_n)
        has_window, window_left, window_right = window_bounds(window, is_causal, seqlen_q, seqlen_k)
        # A side of the window excludes a key only below these bounds: row i sees keys up to
        # Lk_b - Lq + i + right (so right >= Lq - 1 reaches the last key, Lk_b - 1, from every row)
        # and down to Lk_b - Lq + i - left (left >= Lk - 1 reaches key 0 from every row). A window
        # that excludes nothing runs the plain kernel.
        left_bounded = has_window and window_left < seqlen_k - 1
        has_window = left_bounded or (has_window and window_right < seqlen_q - 1)
        # the key tiles a program's splits cut: the cache's, or under a left bound at most the
        # window's span of left + Lq keys (its rows' lower bounds from Lk_b - Lq - left, upper
        # bounds up to Lk_b - 1), off the tile grid
        work_tiles = min(key_tiles, triton.cdiv(window_left + seqlen_q, block_n) + 1) if left_bounded else key_tiles
        self.device = q.device
        mask_strides, mask_head_div = broadcast_layout(None if mask is None else (mask.shape, mask.stride()),
                                                       num_heads, group)
        bias_strides, bias_head_div = broadcast_layout(None if bias is None else (bias.shape, bias.stride()),
                                                       num_heads, group)
        # a program's rows (one KV group's heads, every query) share an operand's row when it has no
        # query dim and one head per group (or none)
        mask_shared, bias_shared = (strides[2] == 0 and (strides[1] == 0 or head_div == group)
                                    for strides, head_div in ((mask_strides, mask_head_div),
                                                              (bias_strides, bias_head_div)))
        padding_mask = mask is not None and mask_shared
        # under a left bound the window is the span (module docstring)
        mask_spans = padding_mask and seqlen_k >= MASK_SPAN_MIN_KEYS and not left_bounded
        splits = config.num_splits or split_count(batch * num_heads_kv * row_blocks, work_tiles, num_sms,
                                                  padding_mask=padding_mask and not mask_spans)
        splits = min(splits, work_tiles, MAX_SPLITS)
        keys_per_split = triton.cdiv(key_tiles, splits) * block_n
        self.splits = triton.cdiv(seqlen_k, keys_per_split)  # no split left without keys
        mask_spans = mask_spans and self.splits > 1
        span_chunks = triton.cdiv(seqlen_k, MASK_SPAN_CHUNK) if mask_spans else 0

        # -- where the split kernel writes: out and lse themselves, or per-split fp32 partials --
        out_strides, lse_strides = (0, *out.stride()), (0, *lse.stride())
        self.out_shape, self.out_dtype, self.lse_shape = tuple(out.shape), out.dtype, tuple(lse.shape)
        self.out_like_q = q.is_contiguous() and q.dtype == out.dtype  # `empty_like(q)` costs the host less
        # what a run allocates beside out: lse, and the partials of the splits
        outputs = {"lse": (tuple(lse.shape), torch.float32)}
        if mask_spans:
            outputs["mask_spans"] = ((batch * num_heads_kv, 2, span_chunks), torch.int32)
        if self.splits > 1:
            partial_out, partial_lse = (self.splits, *out.shape), (self.splits, *lse.shape)
            out_strides, lse_strides = contiguous_strides(partial_out), contiguous_strides(partial_lse)
            outputs.update(partial_out=(partial_out, torch.float32), partial_lse=(partial_lse, torch.float32))
        self.outputs = Workspace(outputs)
        self.spans = None
        if mask_spans:
            self.spans = Launch(
                decode_mask_span_kernel, (batch * num_heads_kv, span_chunks),
                (mask_strides[0], mask_strides[1], mask_strides[3], num_heads_kv, seqlen_k, mask_head_div, span_chunks),
                dict(GROUP=group, CHUNK=MASK_SPAN_CHUNK), num_warps=SPAN_NUM_WARPS,
            )
        self.decode = Launch(
            flash_decode_kernel, (self.splits, batch * num_heads_kv, row_blocks),
            (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *bias_strides, *out_strides, *lse_strides,
             *((0, 0) if block_table is None else (block_table.stride(0), k.shape[0])),
             num_heads_kv, seqlen_q, seqlen_k, keys_per_split, span_chunks, mask_head_div, bias_head_div,
             softmax_scale, softcap if softcap > 0 else 1.0, window_left, window_right),
            dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                 IS_CAUSAL=is_causal, HAS_MASK=mask is not None, HAS_BIAS=bias is not None,
                 HAS_SOFTCAP=softcap > 0, HAS_SEQLENS=seqlens is not None, MASK_SHARED=mask_shared,
                 BIAS_SHARED=bias_shared, PAGED=block_table is not None, PAGE_SIZE=page_size,
                 MASK_SCAN=MASK_SCAN_KEYS, MASK_SPANS=mask_spans,
                 SPAN_CHUNKS=triton.next_power_of_2(max(span_chunks, 1)), HAS_WINDOW=has_window),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        self.combine = None
        if self.splits > 1:
            self.combine = Launch(
                decode_combine_kernel, (batch * seqlen_q * num_heads,),
                (*out_strides, *lse_strides, *out.stride(), *lse.stride(), num_heads, seqlen_q, self.splits),
                dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(self.splits)),
                num_warps=COMBINE_NUM_WARPS,
            )
        self.compiled = False
        # keep_lse -> `allocate_and_run`'s runs as one `native.Program` (None: not native), once the
        # kernels are compiled
        self.native: dict[bool, object] = {}

    def __call__(self, q, k, v, mask, bias, seqlens, block_table, out, lse) -> None:
        """Runs into the given out and lse (the validator's poisoned buffers)."""
        self._run(q, k, v, mask, bias, seqlens, block_table, out, lse)

    def allocate_and_run(self, q, k, v, mask, bias, seqlens, block_table,
                         keep_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs into new outputs: (out, lse). lse is a view of the scratch buffer that holds the
        splits' partials, or its own tensor when the caller keeps it (`keep_lse`: a kept view
        would keep the partials alive)."""
        stream = launch_stream()
        program = self.native.get(keep_lse)
        if program is not None and stream is not None and not launch_context.LAUNCH_OBSERVERS:
            return program(stream, q, k, v, mask, bias, seqlens, block_table)
        out = torch.empty_like(q) if self.out_like_q else torch.empty(self.out_shape, dtype=self.out_dtype,
                                                                       device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if keep_lse else None
        lse = self._run(q, k, v, mask, bias, seqlens, block_table, out, lse)
        if keep_lse not in self.native and stream is not None and all(
                launch.launcher is not None for launch in self._launches()):
            self.native[keep_lse] = self._native_program(q.device, mask, bias, seqlens, block_table, keep_lse)
        return out, lse

    def _launches(self) -> list[Launch]:
        return [launch for launch in (self.spans, self.decode, self.combine) if launch is not None]

    def _native_program(self, device, mask, bias, seqlens, block_table, keep_lse: bool):
        """`allocate_and_run` as one native call (`native.program`): out, lse where the caller keeps
        it, then the scratch buffer with the partials (and lse, returned as its view, where not)."""
        q, k, v, *optional = (native.given(i) for i in range(7))
        extra = [source if given is not None else q  # q: an unused pointer
                 for source, given in zip(optional, (mask, bias, seqlens, block_table))]
        offset = {name: layout[0] for name, layout in self.outputs.layout.items()}
        allocations, views = [(self.out_shape, self.out_dtype)], []
        if keep_lse:
            allocations.append((self.lse_shape, torch.float32))
        scratch = len(allocations)
        allocations.append(((self.outputs.nbytes,), torch.uint8))
        out, lse, returns = native.allocated(0), native.allocated(1), (0, 1)
        if not keep_lse:
            views.append((scratch, offset["lse"] // 4, self.lse_shape, torch.float32))
            lse, returns = native.allocated(scratch, offset["lse"]), (0, scratch + 1)
        spans = q  # an unused pointer
        kernels = []
        if self.spans is not None:
            spans = native.allocated(scratch, offset["mask_spans"])
            kernels.append((self.spans, [extra[0], spans]))
        if self.combine is None:
            kernels.append((self.decode, [q, k, v, *extra, spans, out, lse]))
        else:
            partial_out, partial_lse = (native.allocated(scratch, offset[name])
                                        for name in ("partial_out", "partial_lse"))
            kernels += [(self.decode, [q, k, v, *extra, spans, partial_out, partial_lse]),
                        (self.combine, [partial_out, partial_lse, out, lse])]
        return native.program(device, 7, allocations, views, kernels, returns)

    def _run(self, q, k, v, mask, bias, seqlens, block_table, out, lse) -> torch.Tensor:
        """The launches, lse (None: a view of the scratch buffer) and the splits' partials in one
        allocation; returns lse."""
        stream = launch_stream()
        buffer = self.outputs.allocate(q.device)
        if lse is None:
            lse = self.outputs.tensor(buffer, "lse")
        extra = (q if mask is None else mask, q if bias is None else bias, q if seqlens is None else seqlens,
                 q if block_table is None else block_table)
        by_address = stream is not None and self.compiled
        spans = q  # an unused pointer
        if self.spans is not None:
            spans = self.outputs.part(buffer, "mask_spans", by_address)
            self.spans.run(stream, mask, spans)
        if self.combine is None:
            self.decode.run(stream, q, k, v, *extra, spans, out, lse)
        else:
            partial_out = self.outputs.part(buffer, "partial_out", by_address)
            partial_lse = self.outputs.part(buffer, "partial_lse", by_address)
            self.decode.run(stream, q, k, v, *extra, spans, partial_out, partial_lse)
            self.combine.run(stream, partial_out, partial_lse, out, lse)
        self.compiled = all(launch.launcher is not None for launch in self._launches())
        return lse
