"""Step 9, post-train: SFT, DPO and RL stages, with the instruction and preference data they learn from."""
