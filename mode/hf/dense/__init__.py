"""A dense transformers decoder (Llama, Qwen2, Mistral) made conditional, in place: Mixture-of-Depths layers,
MLPs upcycled into MoE layers, both (MoDE), and the tools that fit, tune, measure and save such a conversion.
The public names are re-exported by ``mode.hf``; this package only groups the files.

    convert         ``to_mod``, ``mod_layers``, ``resolve_layers`` (which layers a conversion takes)
    mod_layer       the ``MoD<Layer>`` class a converted decoder layer becomes (``MoDLayerMixin``)
    mask            the model's 4D mask restricted to a MoD layer's routed tokens
    cache           ``MoDCacheLayer``: the sparse per-layer KV cache (``kv="routed"``)
    routed_queries  attention where every token writes K/V and only routed tokens ask a query (``kv="all"``)
    skip_update     ``SkipUpdate``: a skipped token's fitted low-rank estimate (``skip_rank``)
    update_moments  ``UpdateMoments``: the running sums an estimate is fitted from without holding the tokens
    routing         ``routing(model, "topk" | "causal" | "dense")`` and ``collect_aux`` (MoD and MoE slots)
    router_fit      fitting the routers in closed form from the original model's forwards
    tune            ``router_tune`` (only the routers trained) and ``calibrate`` (the causal thresholds)
    skip_cost       ``skip_costs`` / ``cheapest``: the loss each layer costs when every token skips it
    upcycle         ``upcycle``: dense MLPs become MoE layers of copies; ``MoESlot``, the MLP slot base class
    conversion_io   ``save_conversion`` / ``load_conversion``: a spec plus the added weights
    prune           ``prune_layers`` / ``block_influence``: whole layers deleted (the baseline)
    lora            LoRA adapters on the projections (``add_lora``) and ``merge_lora``
    heal            ``heal`` / ``HealConfig`` / ``HealReport``: training a converted or pruned model at a budget
    macs            analytic MACs per token (``conversion_macs``) and ``plan_to_macs`` (a conversion to a budget)

Imports go one way: ``mode.hf.moe`` uses ``upcycle`` (``MoESlot``) and ``routing`` (``collect_aux``) from
here; nothing here imports ``mode.hf.moe``.
"""
