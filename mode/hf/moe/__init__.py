"""A transformers MoE model (Mixtral, OLMoE, Qwen-MoE, DeepSeek-V3, gpt-oss, ... docs/hf.md's table) adopted:
its sparse MoE blocks become ``mode`` MoE layers on their own tensors, and the model can be written back as a
plain transformers checkpoint. The public names are re-exported by ``mode.hf``; this package only groups the
files.

    families  every supported family as data (one ``Family`` entry per model type; ``REFUSED``, ``NOT_YET``)
    blocks    one block -> a ``MoELayer`` on the block's own tensors, driven by the family's entry
    convert   ``to_mode_moe``, ``moe_report``: the whole model
    saving    ``save_transformers``, the converted model's ``save_pretrained`` and ``load_state_dict`` in the
              family's layout (``transformers_state_dict``)
    weight_init       transformers' ``_init_weights`` / ``init_weights`` on mode's tensors, as the family's
    transformers_api  ``set_experts_implementation`` and the model's metadata (fp32 rule, plans, no-split)

It builds on ``mode.hf.dense``: ``ConvertedMoE`` is a ``MoESlot`` (``dense.upcycle``) and ``collect_aux``
(``dense.routing``) reads it as it reads an upcycled MLP.
"""
