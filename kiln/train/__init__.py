"""Steps 6 and 7, train: one harness (trainer.Trainer) for every stage, the pretraining stage, jobs, optimizers,
checkpoints, loss-spike rollback and goodput. Run any job with ``python -m kiln.train --config job.json``."""
