"""Step 4, plan: how a run uses its hardware. ``memory`` (one node: the memory a rank needs, DDP or FSDP2, activation
checkpointing, micro-batch and accumulation), ``layout`` (a GPU cluster: data, tensor and pipeline parallelism chosen
by estimated step time), ``cost`` (device-hours, energy, money, the compute-optimal size); ``python -m kiln.plan``.
"""
