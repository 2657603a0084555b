"""One attention call for a processor that attends each batch entry separately (Mochi).

diffusers' Mochi processor attends each batch entry in its own call over [its video tokens, its valid text tokens]
(prompts differ in length), while a sparse layer decides one mask per call of the layer. The sparse processor
therefore hands it the batch packed into one entry: video [1, B*Nv, C], text [1, B*Nt, C'] with every text token
marked valid, RoPE tables repeated per entry. Its one attention call then sees q, k, v [1, H, B*Nv + B*Nt, D]:
:meth:`PackedBatch.attend` unpacks them into the joint batch [B, H, Nv + Nt, D] (video first), attends it under
the real text mask (video rows: their own video and valid text keys; text rows: every valid key of their entry)
and packs the output as the processor lays out an entry's: valid text rows first, zeros after.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    """How a batch of B entries of ``video_len`` (Nv) video and Nt text tokens each is packed into one entry.

    Attributes:
        video_len: Nv.
        text_valid: bool [B, Nt], the entries' valid text tokens.
        attn_mask: bool [B, 1, 1, Nv + Nt], the joint batch's key padding (every video token valid).
        text_rows: int64 [B, 1, Nt, 1], each entry's valid text rows first (in order), then its padded ones.
        text_kept: bool [B, 1, Nt, 1], the first (valid) count of rows of each entry.
        rotary: the RoPE tables of one entry [Nv, ...] repeated per entry [B*Nv, ...] (or None).
    """

    video_len: int
    text_valid: torch.Tensor
    attn_mask: torch.Tensor
    text_rows: torch.Tensor
    text_kept: torch.Tensor
    rotary: tuple | None

    @classmethod
    def of(cls, text_mask: torch.Tensor, video_len: int, rotary=None) -> PackedBatch:
        """The packing of a batch whose text mask (``encoder_attention_mask``) is ``text_mask`` [B, Nt] (nonzero:
        valid), with RoPE tables ``rotary`` (tensors [Nv, ...]) or None."""
        if not isinstance(text_mask, torch.Tensor):
            raise TypeError(f"the packed batch needs the text mask (encoder_attention_mask) as a tensor [B, Nt], got "
                            f"{type(text_mask).__name__}")
        if text_mask.dim() != 2:
            raise ValueError(f"expected the text mask (encoder_attention_mask) [B, Nt], got {tuple(text_mask.shape)}")
        valid = text_mask != 0
        batch, text_len = valid.shape
        video = torch.ones(batch, video_len, dtype=torch.bool, device=valid.device)
        rows = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        kept = torch.arange(text_len, device=valid.device) < valid.sum(dim=1, keepdim=True)
        if rotary is not None and batch > 1:
            rotary = tuple(t.repeat(batch, *([1] * (t.dim() - 1))) for t in rotary)
        return cls(video_len, valid, torch.cat([video, valid], dim=1)[:, None, None], rows[:, None, :, None],
                   kept[:, None, :, None], rotary)

    @property
    def batch(self) -> int:
        return self.text_valid.shape[0]

    @property
    def text_len(self) -> int:
        return self.text_valid.shape[1]

    def inputs(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> tuple:
        """(video [1, B*Nv, C], text [1, B*Nt, C'], text mask [1, B*Nt] all valid) of the packed entry, from the
        batch's video [B, Nv, C] and text [B, Nt, C'] tokens."""
        if hidden_states.shape[:2] != (self.batch, self.video_len) or \
                encoder_hidden_states.shape[:2] != self.text_valid.shape:
            raise ValueError(f"expected video [{self.batch}, {self.video_len}, C] and text "
                             f"{list(self.text_valid.shape)} + [C'] tokens, got {tuple(hidden_states.shape)} and "
                             f"{tuple(encoder_hidden_states.shape)}")
        mask = self.text_valid.new_ones(1, self.batch * self.text_len)
        return hidden_states.flatten(0, 1)[None], encoder_hidden_states.flatten(0, 1)[None], mask

    def outputs(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> tuple:
        """The processor's outputs of the packed entry, video [1, B*Nv, C] and text [1, B*Nt, C'], per entry."""
        return (hidden_states.unflatten(1, (self.batch, self.video_len))[0],
                encoder_hidden_states.unflatten(1, (self.batch, self.text_len))[0])

    def _parts(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a packed [1, H, B*Nv + B*Nt, D] tensor: its video [B, H, Nv, D] and text [B, H, Nt, D]."""
        split = self.batch * self.video_len
        if packed.dim() != 4 or packed.shape[0] != 1 or packed.shape[2] != split + self.batch * self.text_len:
            raise ValueError(f"expected the packed batch [1, H, {split + self.batch * self.text_len}, D], got "
                             f"{tuple(packed.shape)}")
        video = packed[0, :, :split].unflatten(1, (self.batch, self.video_len)).transpose(0, 1)
        text = packed[0, :, split:].unflatten(1, (self.batch, self.text_len)).transpose(0, 1)
        return video, text

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """q, k or v of the packed entry [1, H, B*Nv + B*Nt, D] as the joint batch [B, H, Nv + Nt, D]."""
        return torch.cat(self._parts(packed), dim=2)

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """The joint batch's attention output [B, H, Nv + Nt, D] laid out as the processor's for the packed entry
        [1, H, B*Nv + B*Nt, D]: per entry its valid text rows first, zeros after."""
        batch, heads, _, dim = out.shape
        rows = out[:, :, self.video_len:].gather(2, self.text_rows.expand(batch, heads, self.text_len, dim))
        packed = out.new_empty(1, heads, batch * (self.video_len + self.text_len), dim)
        # Each view taken after the previous copy: autograd then knows the copies it follows.
        self._parts(packed)[0].copy_(out[:, :, :self.video_len])
        self._parts(packed)[1].copy_(rows.masked_fill(~self.text_kept, 0))
        return packed

    def attend(self, attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
               *args, **kwargs) -> torch.Tensor:
        """``attend`` (a stand-in for ``F.scaled_dot_product_attention``) of the packed q, k, v [1, H, L, D] on the
        joint batch under its key padding, the output packed back [1, H, L, D]."""
        if attn_mask is not None:
            raise ValueError("a packed batch's attention takes its own text mask; the processor passed another")
        joint = (self.unpack(t) for t in (query, key, value))
        return self.pack(attend(*joint, self.attn_mask, *args, **kwargs))
