"""The attention entry points of the CPU kernels (CpuKernels, cpu.py, inherits them): decode
attention over paged K/V, latent (MLA) decode attention and causal context attention over
chunks. Every tensor is bf16 on CPU (int64 for indices), laid out as each method states.
"""

from __future__ import annotations

import ctypes

import torch


class AttentionKernels:
    _lib: ctypes.CDLL
    amx: bool

    def decode_attention_supported(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        return heads % kv_heads == 0 and bool(
            self._lib.omniflow_decode_attention_supported(heads // kv_heads, head_dim)
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        layer_keys: torch.Tensor,
        layer_values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query token per row over its pages: q [rows, heads, head_dim] (rows strided),
        pages [kv_heads, pages, page_size, head_dim] contiguous, tables [rows, width] and
        lengths [rows] int64 contiguous. Returns [rows, heads, head_dim]."""
        rows, heads, head_dim = q.shape
        kv_heads, _, page_size, _ = layer_keys.shape
        if q.stride()[1:] != (head_dim, 1) or not layer_keys.is_contiguous():
            raise ValueError(f"decode_attention: q strides {q.stride()} or pages strided")
        if not (tables.is_contiguous() and lengths.is_contiguous()):
            raise ValueError("decode_attention: tables and lengths must be contiguous")
        out = q.new_empty((rows, heads, head_dim))
        status = self._lib.omniflow_decode_attention_bf16(
            q.data_ptr(),
            q.stride(0),
            layer_keys.data_ptr(),
            layer_values.data_ptr(),
            layer_keys.stride(0),
            layer_keys.stride(1),
            page_size,
            tables.data_ptr(),
            tables.shape[1],
            lengths.data_ptr(),
            rows,
            *_head_args(heads, kv_heads, head_dim, scale, out),
        )
        _check_heads(status, "decode_attention", heads, kv_heads, head_dim)
        return out

    def latent_decode_attention(
        self,
        q: torch.Tensor,
        firsts: torch.Tensor,
        seconds: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        rank: int,
        scale: float,
    ) -> torch.Tensor:
        """MLA decode attention over latent pages, read in place (latent_attention.c): q
        [rows, heads, width] (rows strided), one layer's latent halves firsts/seconds [pages,
        page_size, half] contiguous (a token's first `half` values, then the other
        width - half), tables [rows, widest] and lengths [rows] int64 contiguous. Returns the
        weighted latents' first `rank` values [rows, heads, rank]."""
        rows, heads, width = q.shape
        _, page_size, half = firsts.shape
        if q.stride()[1:] != (width, 1) or not (firsts.is_contiguous() and seconds.is_contiguous()):
            raise ValueError(f"latent_decode_attention: q strides {q.stride()} or pages strided")
        if seconds.shape != firsts.shape:
            raise ValueError(
                f"latent_decode_attention: halves {tuple(firsts.shape)} != {tuple(seconds.shape)}"
            )
        if not (tables.is_contiguous() and lengths.is_contiguous()):
            raise ValueError("latent_decode_attention: tables and lengths must be contiguous")
        out = q.new_empty((rows, heads, rank))
        status = self._lib.omniflow_latent_decode_attention_bf16(
            q.data_ptr(),
            q.stride(0),
            heads,
            width,
            rank,
            firsts.data_ptr(),
            seconds.data_ptr(),
            half,
            page_size,
            tables.data_ptr(),
            tables.shape[1],
            lengths.data_ptr(),
            rows,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"latent_decode_attention: width {width}, half {half}, rank {rank} unsupported"
            )
        return out

    def context_attention_supported(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether context_attention and chunks_attention run here for these heads: on AMX
        tiles where `amx`, else on AVX-512 BF16 dot products."""
        return bool(self._lib.omniflow_context_attention_supported(heads, kv_heads, head_dim))

    def context_attention(
        self,
        q: torch.Tensor,
        layer_keys: torch.Tensor,
        layer_values: torch.Tensor,
        pages: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one sequence's chunk of new tokens over its context (on AMX where
        `amx`, else AVX-512 BF16): q [chunk,
        heads, head_dim] (rows strided) at positions start.., their own K/V already in the
        pages [kv_heads, pages, page_size, head_dim] (contiguous) listed by `pages` (int64,
        contiguous, enough for start + chunk tokens); causal. Returns [chunk, heads,
        head_dim]. Needs context_attention_supported."""
        chunk, heads, head_dim = q.shape
        kv_heads, _, page_size, _ = layer_keys.shape
        if q.stride()[1:] != (head_dim, 1) or not layer_keys.is_contiguous():
            raise ValueError(f"context_attention: q strides {q.stride()} or pages strided")
        if not pages.is_contiguous() or len(pages) * page_size < start + chunk:
            raise ValueError(
                f"context_attention: {len(pages)} pages of {page_size} do not hold "
                f"{start} + {chunk} tokens"
            )
        strides = (layer_keys.stride(0), layer_keys.stride(1), page_size)
        return self._chunk_attention(
            q, layer_keys, layer_values, kv_heads, strides, pages, 0, start, 1, scale
        )

    def chunks_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int, scale: float
    ) -> torch.Tensor:
        """Causal attention within `chunks` equal prompts with no cached context (as
        context_attention): q [chunks * tokens, heads, head_dim], k/v [chunks * tokens,
        kv_heads, head_dim], rows strided (k and v alike). Returns [rows, heads, head_dim]."""
        rows, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        if (
            rows % max(chunks, 1)
            or k.shape != v.shape
            or k.shape[0] != rows
            or k.stride() != v.stride()
            or k.stride()[1:] != (head_dim, 1)
            or q.stride()[1:] != (head_dim, 1)
        ):
            raise ValueError(
                f"chunks_attention: q {tuple(q.shape)} / k {tuple(k.shape)} strides "
                f"{q.stride()} / {k.stride()} are not {chunks} equal chunks"
            )
        tokens = rows // max(chunks, 1)
        rows_as_pages = (head_dim, k.stride(0), 1)  # a row a one-token page
        identity = torch.arange(tokens)
        return self._chunk_attention(
            q, k, v, kv_heads, rows_as_pages, identity, tokens * k.stride(0), 0, chunks, scale
        )

    def _chunk_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        kv_heads: int,
        strides: tuple[int, int, int],
        table: torch.Tensor,
        kv_step: int,
        start: int,
        count: int,
        scale: float,
    ) -> torch.Tensor:
        """omniflow_chunk_attention_bf16 over `count` equal chunks of q's rows. strides: of
        keys/values, (between kv heads, between pages, tokens a page); kv_step: between
        chunks' keys (elements)."""
        rows, heads, head_dim = q.shape
        out = q.new_empty((rows, heads, head_dim))
        head_stride, page_stride, page_size = strides
        status = self._lib.omniflow_chunk_attention_bf16(
            q.data_ptr(),
            q.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            head_stride,
            page_stride,
            page_size,
            table.data_ptr(),
            kv_step,
            start,
            rows // max(count, 1),
            count,
            heads,
            kv_heads,
            head_dim,
            scale,
            out.data_ptr(),
            int(self.amx),
            torch.get_num_threads(),
        )
        _check_heads(status, "context_attention", heads, kv_heads, head_dim)
        return out


def _head_args(heads: int, kv_heads: int, head_dim: int, scale: float, out: torch.Tensor):
    """The attention kernels' last arguments: heads, kv heads, head size, scale, out, threads."""
    return heads, kv_heads, head_dim, scale, out.data_ptr(), torch.get_num_threads()


def _check_heads(status: int, name: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """An attention kernel's refusal (status -1) as the error it is."""
    if status != 0:
        check = "decode" if name == "decode_attention" else "context"
        raise ValueError(
            f"{name}: {heads} heads over {kv_heads} kv heads of {head_dim} not supported by "
            f"this build (check {check}_attention_supported first)"
        )
