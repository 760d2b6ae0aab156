"""Packed rows: several documents in one row of the batch (padding-free packing).

Spans are taken per (row, key/value head) over the keys some query attends to, so a row that holds
several documents needs to be split first: each document gets the spans of its own keys, as if it
ran alone. Transformers tells the attention where documents start in one of two ways:

- `cu_seq_lens_q/k` and `max_length_q/k` keyword arguments (FlashAttention's varlen form, from
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`), read without a host sync when
  `max_length_q` is a Python int; they are read only while a CUDA graph is captured, where the mask
  cannot be: else the mask decides, since the forward pass attends to it as SDPA does (which
  ignores cu_seq_lens), so cu_seq_lens that disagree with it change nothing;
- for SDPA-style masks, a block-diagonal 4-D mask that `masking_utils` builds from position ids
  restarting per document (`find_packed_sequence_indices`). The mask is what the forward pass
  attends to, so the documents are read from it (position ids alone do not say whether the mask
  separates them: with a 2-D padding mask it does not). One host sync reads how many documents
  there are and the longest; the result is kept for the mask tensor that all layers share.

While a CUDA graph is captured nothing is read on the host: the mask is not read (`from_mask`
gives "captured", and the mask is used as it is), and `cu_seq_lens` are, as always, read on the
device, with `max_length_q` (a Python int, frozen into the graph as FlashAttention's is) or else
the row length T as the documents' length, each document keeping its part of the mask (a sliding window).

`unpack` gathers the rows into a padded batch of documents (N, H, L, D) with a padding (+ causal)
mask, `repack` gathers the output back; autograd carries the gradients through both gathers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from hf_spanattn.ops import tile_engine
from hf_spanattn.ops.inputs import LastMaskRead, as_int, attended, capturing, shown


@dataclass(frozen=True)
class Documents:
    """Where each document of the packed rows goes in a padded batch of N documents of length L.

    source: (N·L,) for each slot of the padded batch, its token in the flattened (B·T) rows (B·T
        for an empty slot, which reads a zero row); target: (B·T,) for each token, its slot (N·L
        for a token in no document, which reads a zero row); mask: (N, 1, L, L) bool."""

    source: torch.Tensor
    target: torch.Tensor
    mask: torch.Tensor
    count: int
    length: int


def unpack(x: torch.Tensor, docs: Documents) -> torch.Tensor:
    """(B, H, T, D) packed rows → (N, H, L, D) documents, zeros in the empty slots."""
    b, h, t, d = x.shape
    rows = torch.cat([x.transpose(1, 2).reshape(b * t, h, d), x.new_zeros(1, h, d)])
    return rows.index_select(0, docs.source).view(docs.count, docs.length, h, d).transpose(1, 2)


def repack(out: torch.Tensor, docs: Documents, b: int, t: int) -> torch.Tensor:
    """(N, H, L, D) documents → (B, T, H, D) packed rows, zeros for tokens in no document."""
    n, h, length, d = out.shape
    slots = torch.cat([out.transpose(1, 2).reshape(n * length, h, d), out.new_zeros(1, h, d)])
    return slots.index_select(0, docs.target).view(b, t, h, d)


def rows_dropout(query: torch.Tensor, docs: Documents, dropout_p: float) -> contextlib.AbstractContextManager:
    """Under dropout, the documents' attention on the tiles takes the dropout mask SDPA draws over the packed rows
    of `query` (B, H_q, T, D): bernoulli(1 − p) over (B, H_q, T, T), each document given the part on its own tokens.
    The stock model's forward pass and the random numbers drawn after it are then the patched model's."""
    if not dropout_p > 0:
        return contextlib.nullcontext()

    def draw() -> torch.Tensor:
        b, h, t, _ = query.shape
        keep = query.new_empty(b, h, t, t).bernoulli_(1 - dropout_p).bool()
        rows = torch.cat([keep.transpose(1, 2).reshape(b * t, h, t), keep.new_zeros(1, h, t)])  # (query token, H, key)
        rows = rows.index_select(0, docs.source).view(docs.count, docs.length, h, t)
        keys = (docs.source % t).view(docs.count, 1, 1, docs.length).expand(-1, docs.length, h, -1)
        return rows.gather(-1, keys).transpose(1, 2)  # (N, H_q, L, L); an empty slot's entries are masked anyway

    return tile_engine.drawn_by(draw)


def _documents(doc: torch.Tensor, pos: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, count: int,
               length: int, causal: bool) -> Documents:
    """doc (B, T): each token's document in 0..count-1, or −1; pos: its place in the document;
    queries/keys: whether it attends as a query / is attended as a key."""
    b, t = doc.shape
    device = doc.device
    slots = count * length
    target = torch.where(doc >= 0, doc * length + pos, slots).flatten()
    tokens = torch.arange(b * t, device=device)
    source = torch.full((slots + 1,), b * t, device=device, dtype=tokens.dtype).scatter_(0, target, tokens)[:-1]

    def per_slot(flag: torch.Tensor) -> torch.Tensor:
        empty = torch.zeros(slots + 1, dtype=torch.bool, device=device)
        return empty.scatter_(0, target, flag.flatten() & (doc >= 0).flatten())[:-1].view(count, length)

    mask = per_slot(queries)[:, None, :, None] & per_slot(keys)[:, None, None, :]
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return Documents(source, target, mask, count, length)


def from_cu_seq_lens(cu_seq_lens: torch.Tensor, max_length: Any, t: int, causal: bool) -> Documents:
    """FlashAttention's varlen form for one packed row of t tokens: document i holds the tokens
    cu_seq_lens[i]:cu_seq_lens[i+1]; tokens from cu_seq_lens[-1] on are in none. `max_length`, the
    longest document (an int, as `as_int` reads it; one past t counts as t), is read from cu_seq_lens where not
    given, except under CUDA graph capture: then a given Python or NumPy int must bound the documents of every
    replay, and t does otherwise."""
    cu = cu_seq_lens.to(torch.long)
    count = cu.numel() - 1
    graph = capturing(cu)
    given = None if graph and isinstance(max_length, torch.Tensor) else as_int(max_length)  # no host read under capture
    if given is not None and given < 1:
        raise ValueError(f"max_length_q: the length of the longest packed document, a positive int; "
                         f"got {shown(max_length)}")
    if given is not None:
        length = min(given, t)  # no document is longer than the row
    else:
        length = t if graph else int((cu[1:] - cu[:-1]).max())  # a host sync
    index = torch.arange(t, device=cu.device)
    doc = torch.searchsorted(cu, index, right=True) - 1
    inside = (index >= cu[0]) & (index < cu[-1])
    doc = torch.where(inside, doc, -1)
    pos = index - cu[doc.clamp(0, max(count - 1, 0))]
    return _documents(doc[None], pos[None], inside[None], inside[None], count, length, causal)


_last_read = LastMaskRead(while_capturing="captured")
_SAID = {"msg": "span_attention reads a 4-D attention mask on the host to find the documents packed into a row, "
                "which breaks the graph (fullgraph=True fails): leave the mask out to compile without a break (no "
                "padding or packing, use_cache left on, as Transformers from 5.18 on then passes none)"}
if "msg" not in inspect.signature(torch._dynamo.graph_break).parameters:  # torch before 2.7 says no more than the break
    _SAID = {}


def from_mask(mask: torch.Tensor, b: int) -> Documents | None | str:
    """The documents of a block-diagonal 4-D mask (B or 1, H or 1, T, T): a Documents where some row
    holds several, None where every row holds at most one, "unreadable" where a row is cut into
    blocks that are not a block-diagonal mask of whole documents, bidirectional or causal (each document's own
    part of a causal mask, as a sliding window's, is kept), "captured"
    while a CUDA graph is captured (then the mask is not read). None on the meta device, which holds no mask to read
    (span_attention there gives SDPA's shapes)."""
    if mask.device.type == "meta":
        return None
    if torch.compiler.is_compiling() and not capturing(mask):  # the read is a host sync: the graph breaks here
        torch._dynamo.graph_break(**_SAID)
    return _last_read(mask, lambda: _read_mask(mask, b), b)


def _read_mask(mask: torch.Tensor, b: int) -> Documents | None | str:
    allowed = attended(mask)
    m = allowed[:, 0].expand(b, -1, -1)  # (B, T, T)
    t = m.shape[-1]
    index = torch.arange(t, device=mask.device)
    queries, keys = m.any(-1), m.any(-2)  # rows that attend something, keys some row attends
    # a document starts at a query whose first attended key is itself
    starts = queries & (m.to(torch.uint8).argmax(-1) == index)
    per_row = starts.sum(-1)
    doc = starts.cumsum(-1) - 1
    doc = torch.where(doc >= 0, doc + (per_row.cumsum(0) - per_row)[:, None], -1)
    pos = index - torch.cummax(torch.where(starts, index, 0), -1).values
    blocks = (doc[:, :, None] == doc[:, None, :]) & (doc >= 0)[:, :, None] & queries[:, :, None] & keys[:, None, :]
    causal = blocks & torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()
    plain = (allowed == allowed[:, :1]).all()  # every head the same
    if mask.dtype != torch.bool:  # an additive mask: 0 where attended (no bias) and no empty row
        plain = plain & (torch.where(allowed, mask, 0) == 0).all() & queries.all()
    flags = torch.stack([x.to(torch.long) for x in ((per_row > 1).any(), plain, (m == causal).all(),
                                                    (m == blocks).all(), (m <= causal).all(), per_row.sum(),
                                                    torch.where(doc >= 0, pos + 1, 0).max())])
    packed, plain, is_causal, is_blocks, in_causal, count, length = flags.tolist()  # the one host sync
    if not packed:
        return None
    if not plain or not (is_causal or is_blocks or in_causal):
        return "unreadable"
    docs = _documents(doc, pos, queries, keys, count, length, bool(is_causal))
    # causal within each document but not all of it (a sliding window): each document keeps its own part of the mask
    return docs if is_causal or is_blocks else within(docs, mask, b)


def within(docs: Documents, mask: torch.Tensor, b: int) -> Documents:
    """`docs` with each document's mask limited to its own part of the 4-D mask (B or 1, H or 1, T, T) that the
    forward pass attends to (a sliding window's, or none across documents), gathered on the device."""
    m = attended(mask)[:, 0].expand(b, -1, -1)
    n, length, t = docs.count, docs.length, m.shape[-1]
    rows = torch.cat([m.reshape(-1, t), m.new_zeros(1, t)]).index_select(0, docs.source).view(n, length, t)
    own = rows.gather(-1, (docs.source % t).view(n, 1, length).expand(-1, length, -1))
    return dataclasses.replace(docs, mask=own[:, None] & docs.mask)
