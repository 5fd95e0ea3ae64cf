"""Expert-parallel training: shard a model's experts over a process group (``ep_model``), train it with
the batch split over the same ranks and write single-process checkpoints (``train_ep``)."""
