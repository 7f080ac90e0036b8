"""Oracle drafters: draft logits that put the target's own continuation in the tree."""

from __future__ import annotations

import torch

from vllm_ddtree.reference import DFlashDraftModel


class OracleDrafter(DFlashDraftModel):
    """A DFlash drafter whose logits rank the true next tokens as told.

    ``truth`` is the whole sequence (prompt + the target's own output) and
    ``ranks[d-1]`` the rank (0 = most probable) the true token gets at depth d;
    the other logits are seeded noise. Context handling is the real drafter's.
    """

    def set_oracle(self, truth: list[int], ranks: list[int]) -> OracleDrafter:
        self.truth = truth
        self.ranks = ranks
        return self

    def block_logits(self, bonus, position, context, embed, lm_head):
        real = super().block_logits(bonus, position, context, embed, lm_head)
        depths, vocab = real.shape
        gen = torch.Generator().manual_seed(position)
        logits = 0.5 * torch.randn(depths, vocab, generator=gen)
        for d in range(1, depths + 1):
            if position + d >= len(self.truth):
                break
            token, rank = self.truth[position + d], self.ranks[d - 1]
            # Confident drafts: the true token gets about 80 % at rank 0; at rank r,
            # r decoys sit just above it.
            logits[d - 1, token] = 6.0
            decoys = [t for t in torch.randperm(vocab, generator=gen).tolist() if t != token]
            for j, decoy in enumerate(decoys[:rank]):
                logits[d - 1, decoy] = 6.0 + 0.5 * (rank - j)
        return logits
