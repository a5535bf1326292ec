"""A block-diffusion drafter in miniature, for ``graphpass.audit``: one of each allocation kind.

Sizes vary with the packed sequence length ``T`` (dim 1 of ``ids``, ``hidden`` and ``loss_mask``):

- anchor selection: ``nonzero`` of the loss mask, then ``randperm`` over the valid count and an
  index by the first ``num_anchors`` of it (data-dependent sizes);
- position ids from ``arange(T)`` (size from the input length only);
- the context embedding and the fixed-size mask-token embedding, the latter expanded (a view, no
  allocation per length), concatenated along the length;
- attention scores ``[B, T, T + block]`` (quadratic in the length);
- the LM head and its loss under ``torch.utils.checkpoint.checkpoint`` (recomputed in backward).

``factory()`` gives ``(model, example_inputs)`` for ``graphpass audit``; :data:`DYNAMIC` is the
matching ``dynamic=`` (``graphpass audit graphpass.models.audit_example:factory --dynamic
ids=1:8:512 --dynamic hidden=1:8:512 --dynamic loss_mask=1:8:512``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MAX_LEN = 512
EXAMPLE_LEN = 64

DYNAMIC = {
    "ids": {1: (8, MAX_LEN)},
    "hidden": {1: (8, MAX_LEN)},
    "loss_mask": {1: (8, MAX_LEN)},
}


class AnchorDrafter(nn.Module):
    def __init__(
        self,
        vocab: int = 96,
        dim: int = 32,
        block: int = 4,
        num_anchors: int = 8,
        max_len: int = MAX_LEN,
        mask_token_id: int = 1,
    ) -> None:
        super().__init__()
        self.num_anchors = num_anchors
        self.mask_token_id = mask_token_id
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Embedding(max_len + 1, dim)
        self.register_buffer("mask_ids", torch.full((1, block), mask_token_id), persistent=False)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def select_anchors(self, loss_mask: torch.Tensor) -> torch.Tensor:
        valid = torch.nonzero(loss_mask[0]).squeeze(-1)
        order = torch.randperm(valid.numel(), device=valid.device)
        return valid[order[: self.num_anchors]]

    def _lm_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, loss_mask: torch.Tensor):
        batch, length = ids.shape
        anchors = self.select_anchors(loss_mask)
        position_ids = (1 + torch.arange(length, device=ids.device)).unsqueeze(0)
        ctx = self.embed(ids) + hidden + self.pos_embed(position_ids)
        noise = self.embed(self.mask_ids).expand(batch, -1, -1)
        kv = torch.cat([self.kv(ctx), noise], dim=1)
        scores = self.q(ctx) @ kv.transpose(1, 2)
        h = ctx + scores.softmax(-1) @ kv
        loss = checkpoint(self._lm_loss, h, ids, use_reentrant=False)
        return loss, ids[0, anchors]


def factory(seed: int = 0, length: int = EXAMPLE_LEN):
    """``(model, (ids, hidden, loss_mask))`` with random weights; the model is in training mode."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = AnchorDrafter()
    ids = torch.randint(0, 96, (1, length), generator=g)
    hidden = torch.randn(1, length, 32, generator=g)
    loss_mask = torch.rand(1, length, generator=g) > 0.3
    return model, (ids, hidden, loss_mask)
