"""What a model costs and how it routes: analytic FLOPs, routing statistics, per-token compute, host syncs.

    flops          forward and training FLOPs per token of an ``LMConfig`` (realised routing or planned)
    stats          ``RoutingAccumulator``: load balance and per-token compute summed over calls, steps, ranks
    token_compute  blocks, MLP assignments and FLOPs of every token of one forward
    host_sync      ``HostSyncCounter``: count would-be device-to-host synchronisations in a region (any device);
                   ``CudaSyncCounter``: the syncs CUDA itself reports there (GPU ground truth)

Built on the library core only; never imports ``torch.distributed`` (docs/architecture.md).
"""
