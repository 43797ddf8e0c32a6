"""The allowed-token mask of a step's constrained rows, and applying it to logits.

``TokenMasker.fill`` asks each row's llguidance matcher for its next-token
bitmask (one bit per token id in int32 words: bit j of word i is token 32*i + j),
on llguidance's own threads for the whole batch at once. ``apply_token_mask``
adds 0 to every allowed logit and -inf to every other, before any other
sampling transform, so no sampler path (greedy, top-k, top-p, min-p,
penalties) can pick a disallowed token.

Why a bias and not a boolean select: the packed words are read as bytes, and
each byte indexes a 256 x 8 table of biases (``np.take`` of 8 floats per byte),
which expands a [64, 49152] mask in about 2 ms; unpacking to booleans and
``torch.where`` / ``masked_fill`` took 20-40 ms on the same CPU (a
data-dependent branch per element). Adding -inf keeps a -inf and turns any
finite logit into -inf; logits are finite or -inf by then (``finite_logits``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

MAX_MASK_THREADS = 4
# byte value -> the biases of its 8 tokens (bit b of the byte is token 8*k + b): 0 allowed, -inf not
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)  # [256, 8]


@dataclass(frozen=True)
class TokenMask:
    """Which rows of a logits batch are constrained and what each may pick.

    rows: indices into the batch, increasing; bitmask: [len(rows), ceil(V / 32)]
    int32, little-endian words, bit j of word i set when token 32*i + j is allowed.
    """

    rows: list[int]
    bitmask: np.ndarray
    bias: torch.Tensor | None = None  # [len(rows), V] float32 of ``mask_bias`` when already made (TokenMasker.bias)

    @classmethod
    def from_allowed(cls, rows: list[int], allowed: torch.Tensor) -> TokenMask:
        """From a [len(rows), V] bool tensor (True: allowed)."""
        num_words = (allowed.shape[1] + 31) // 32
        padded = np.zeros((allowed.shape[0], num_words * 32), dtype=np.bool_)
        padded[:, : allowed.shape[1]] = allowed.numpy()
        return cls(rows, np.packbits(padded, axis=1, bitorder="little").view("<i4"))

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[len(rows), vocab_size] bool: True where the row's grammar allows the token."""
        return unpack_bitmask(self.bitmask, vocab_size)


class TokenMasker:
    """Fills the bitmasks of a batch of matchers; holds llguidance's thread pool."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        threads = num_threads if num_threads is not None else min(MAX_MASK_THREADS, os.cpu_count() or 1)
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._bias_buffer: np.ndarray | None = None  # [rows, 4 * words, 8] float32, grown as batches grow

    def fill(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), ceil(vocab_size / 32)] int32: the tokens each matcher allows next.

        A matcher in an error state allows nothing (a row of zeros).
        """
        bitmask = np.zeros((len(matchers), self.num_words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(matcher, index) for index, matcher in enumerate(matchers)],
            bitmask.ctypes.data,
            self.num_words * 4,
            len(matchers),
        )
        return bitmask

    def bias(self, bitmask: np.ndarray) -> torch.Tensor:
        """``mask_bias`` of ``bitmask`` [n, words], written into a buffer this masker reuses: a fresh
        [64, 49152] float32 array each step costs its page faults again. Valid until the next call."""
        num_rows = len(bitmask)
        if self._bias_buffer is None or len(self._bias_buffer) < num_rows:
            self._bias_buffer = np.empty((num_rows, self.num_words * 4, 8), dtype=np.float32)
        return mask_bias(bitmask, self.vocab_size, out=self._bias_buffer[:num_rows])


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[n, ceil(V / 32)] int32 words -> [n, V] bool; bit j of word i is token 32*i + j.

    The words are little-endian int32, so as bytes, bit b of byte k is token 8*k + b:
    numpy's ``unpackbits(bitorder="little")`` reads them in token order.
    """
    as_bytes = bitmask.astype("<i4", copy=False).view(np.uint8)  # [n, 4 * words]
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size]  # [n, V] uint8
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.bool_))


def mask_bias(bitmask: np.ndarray, vocab_size: int, out: np.ndarray | None = None) -> torch.Tensor:
    """[n, V] float32: 0 where the bitmask allows the token, -inf elsewhere (one table lookup per byte).

    out: a contiguous [n, 4 * words, 8] float32 array to write into (None: a new one).
    """
    as_bytes = np.ascontiguousarray(bitmask.astype("<i4", copy=False)).view(np.uint8)  # [n, 4 * words]
    bias = np.take(_BYTE_BIAS, as_bytes, axis=0, out=out).reshape(len(bitmask), -1)  # [n, 32 * words]
    return torch.from_numpy(bias[:, :vocab_size])


def apply_token_mask(logits: torch.Tensor, mask: TokenMask, *, in_place: bool = False) -> torch.Tensor:
    """``logits`` [num_seqs, V] with each masked row's disallowed tokens at -inf: a copy, or
    ``logits`` itself changed when ``in_place`` (the caller needs no unmasked logits: no logprobs).

    logits: finite or -inf (after ``finite_logits``). A masked row left with no
    finite logit (the model gave -inf to every allowed token, or min_tokens banned
    the only ones) becomes 0 on its allowed tokens: uniform over them, so even then
    the draw stays inside the mask. A row with no allowed token stays all -inf
    (the engine discards its token and aborts the request).
    """
    with torch.inference_mode(logits.is_inference()):  # the runner's logits are inference tensors
        return _apply(logits if in_place else logits.clone(), mask)


def _apply(out: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    bias = mask.bias if mask.bias is not None else mask_bias(mask.bitmask, out.shape[1])
    bias = bias.to(out.device)  # [k, V]
    index = torch.tensor(mask.rows, device=out.device)
    if len(mask.rows) == out.shape[0]:
        out.add_(bias)  # every row is constrained, in batch order
    else:
        out.index_add_(0, index, bias)
    row_max = out.amax(dim=-1).index_select(0, index)  # [k]
    no_mass = torch.nonzero(row_max == float("-inf")).flatten()
    if len(no_mass):
        out[index[no_mass]] = bias[no_mass]
    return out
