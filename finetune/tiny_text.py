"""The text side of ``attnqat finetune tiny``: the pipeline's prompt encoding, made differentiable
so the text encoder trains with the transformer; the text-binding loss and the measure of whether
the encoder's states tell which object does what; the attention rescaling of a saturated encoder."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from attnqat.finetune.tiny_config import TEXT_SEQ_LEN
from attnqat.synthetic import COLOURS, MOTION_PHRASE, MOTIONS, SHAPES, ClipSpec


def tokenize(tokenizer, captions: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, padded to ``length`` (as the pipeline tokenizes)."""
    enc = tokenizer(captions, padding="max_length", max_length=length, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def encode_text(text_encoder, ids: torch.Tensor, mask: torch.Tensor,
                seq_len: int = TEXT_SEQ_LEN) -> torch.Tensor:
    """What ``WanPipeline.encode_prompt`` computes: the encoder's states of the real tokens, zeros
    after them, ``seq_len`` rows. The encoder masks the padding, so a shorter padded length gives
    the same states."""
    h = text_encoder(ids, attention_mask=mask).last_hidden_state
    h = h * mask.unsqueeze(-1).to(h.dtype)
    return F.pad(h, (0, 0, 0, seq_len - h.shape[1]))


@torch.no_grad()
def binding_signal(text_encoder, tokenizer, specs: list[ClipSpec], length: int = 32) -> float | None:
    """How far apart the prompt embeddings of a two-object caption and of the same caption with
    the two motions exchanged are, as the transformer sees them.

    Wan's cross-attention has no positions on the text side: it sees the encoder's token states
    as a set. If the two sets are equal, the transformer cannot tell which object moves how. Per
    caption: for each token state of the caption, the distance to the nearest state of the
    swapped caption relative to its norm; the largest over the tokens; averaged over the
    two-object ``specs`` (``None`` if there are none). 0 means order-blind (a bag of words)."""
    pairs = []
    for spec in specs:
        if len(spec.objects) == 2:
            a, b = spec.objects
            swapped = ClipSpec((replace(a, motion=b.motion), replace(b, motion=a.motion)),
                               spec.background)
            pairs.append((spec.caption, swapped.caption))
    if not pairs:
        return None
    dev = next(text_encoder.parameters()).device
    ids, mask = tokenize(tokenizer, [c for pair in pairs for c in pair], length)
    h = text_encoder(ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state.float()
    n = mask.sum(1)
    gaps = []
    for k in range(len(pairs)):
        x, y = h[2 * k, :n[2 * k]], h[2 * k + 1, :n[2 * k + 1]]
        near = torch.cdist(x, y).min(dim=1).values / x.norm(dim=1).clamp_min(1e-12)
        gaps.append(float(near.max()))
    return float(np.mean(gaps))


class TextBindingHead(torch.nn.Module):
    """An auxiliary loss that makes the text encoder's token states carry the binding of a caption.

    For every object of a caption, read from its words: the state of its shape word must predict
    the object's colour and motion, and the state of its colour word its shape and motion (one
    linear layer, cross-entropy). A bag-of-words encoder cannot do this for two-object captions
    (:func:`binding_signal`), so the loss pushes the encoder to attend along the word order. The
    head is used in training only and never saved; the labels come from the token ids (the
    caption grammar of :mod:`attnqat.synthetic`), so no extra data is needed."""

    def __init__(self, tokenizer, width: int) -> None:
        super().__init__()
        vocab = max(tokenizer.get_vocab().values()) + 1
        # a motion is named by the last word of its phrase ("moves left" -> left, "grows")
        phrases = [MOTION_PHRASE[m].split() for m in MOTIONS]
        words = {"colour_of": COLOURS, "shape_of": SHAPES, "motion_of": [w[-1] for w in phrases]}
        for table, names in words.items():   # token id -> attribute index, -1 for other words
            lookup = torch.full((vocab,), -1, dtype=torch.long)
            for k, w in enumerate(names):
                lookup[tokenizer.convert_tokens_to_ids(w)] = k
            self.register_buffer(table, lookup, persistent=False)
        (moves,) = {w[0] for w in phrases if len(w) == 2}   # the verb of two-word phrases
        self.moves = tokenizer.convert_tokens_to_ids(moves)
        self.proj = torch.nn.Linear(width, len(COLOURS) + len(SHAPES) + len(MOTIONS))

    def forward(self, states: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, accuracy) over the attribute predictions of the batch's objects (fixed shapes,
        no host synchronization: every position is scored, the non-shape ones masked out)."""
        nxt = F.pad(ids[:, 1:], (0, 1))
        nxt2 = F.pad(ids[:, 2:], (0, 2))
        # per shape word at p: its colour (p - 1), shape (p) and motion (p + 1, or p + 2 after "moves")
        shape = self.shape_of[ids[:, 1:]]
        colour = self.colour_of[ids[:, :-1]]
        motion = self.motion_of[torch.where(nxt == self.moves, nxt2, nxt)[:, 1:]]
        valid = (shape >= 0) & (colour >= 0) & (motion >= 0)
        logits = self.proj(states.float())
        at_shape, at_colour = logits[:, 1:], logits[:, :-1]
        nc, ns = len(COLOURS), len(SHAPES)
        preds = [(at_shape[..., :nc], colour), (at_shape[..., nc + ns:], motion),
                 (at_colour[..., nc:nc + ns], shape), (at_colour[..., nc + ns:], motion)]
        w = valid.float()
        n = w.sum().clamp_min(1.0)
        loss = sum((F.cross_entropy(lg.transpose(1, 2), y.clamp_min(0), reduction="none") * w).sum()
                   for lg, y in preds) / (len(preds) * n)
        with torch.no_grad():
            acc = sum(((lg.argmax(-1) == y).float() * w).sum() for lg, y in preds) / (len(preds) * n)
        return loss, acc


def scale_text_attention(text_encoder, factor: float) -> None:
    """Multiply every self-attention logit of a T5-style encoder by ``factor`` (its query and key
    weights by the square root): a way out of saturated, one-hot attention, whose gradients
    vanish. Changes the encoder's function; the training that follows has to adapt to it."""
    root = math.sqrt(factor)
    with torch.no_grad():
        for block in text_encoder.encoder.block:
            att = block.layer[0].SelfAttention
            att.q.weight.mul_(root)
            att.k.weight.mul_(root)
