"""The lab, built on the library and used by nothing in it: ``mode compare``, ``mode isoflop`` and
``mode report``, with the pieces they share.

    compare     dense, MoD, MoE, staged and integrated MoDE at matched training FLOPs
    isoflop     isoFLOP sweeps: every variant at several sizes and budgets, best against best
    isoflop_report  the parabola fits, tables and plots of a sweep
    sweep       one training run of a sweep at a FLOP budget, and its validation windows
    run_record  a run folder's identity (arguments, data fingerprint) and resumable results
    stats_ci    paired differences, intervals and significance over seeds
    report      routing and per-token compute report of a trained checkpoint
"""
