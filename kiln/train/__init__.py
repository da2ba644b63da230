"""Steps 6 and 7, train: the job, the loop, optimizers, checkpoints, loss-spike rollback and goodput."""
