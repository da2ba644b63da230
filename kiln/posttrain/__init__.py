"""Step 9, post-train: the SFT, DPO and RL stages of the shared trainer, the instruction and preference data they
learn from, sampling, log-probabilities and the held-out measures. Run a job with ``python -m kiln.posttrain --config job.json``."""
