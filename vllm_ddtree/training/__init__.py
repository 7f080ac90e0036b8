"""Training of the embedded model pair: an MLA target and its DFlash drafter.

Modules:
- ``corpus``: the Python standard library as a corpus (file split, BPE tokenizer,
  flat ``uint16`` token arrays, manifest).
- ``configs``: the target (``DeepseekV3ForCausalLM``) and drafter
  (``DFlashDraftModel``) configs, full size and tiny.
- ``common``: seeding, LR schedule, time-budgeted step planning, checkpoint saving,
  loss plots.
- ``train_target``: next-token training of the target, held-out perplexity.
- ``drafter_forward``: the batched DFlash training forward (many anchors per
  sequence in one pass), equal to the reference ``DFlashDraftModel.block_logits``.
- ``train_drafter``: greedy continuations of the frozen target, aux hidden states,
  DFlash block training.

``evals/train_pair.py`` runs everything on one device.
"""
