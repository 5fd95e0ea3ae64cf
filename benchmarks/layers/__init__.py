"""Layer benchmarks: routed layers vs dense, MoE parts and expert GEMMs, peers, decode, op and sync counts."""
