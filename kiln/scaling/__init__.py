"""Step 4's evidence: sweeps, scaling-law fits and ladders that decide a run's size and hyper-parameters before it is paid for."""
