"""Training benchmarks: bf16 against float32, the MoD recipe ablation."""
