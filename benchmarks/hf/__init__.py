"""Benchmarks of the Hugging Face integration (mode.hf): MoD on pretrained models, MoE bytes, LongCat budget."""
