"""Trainer settings every benchmark run shares: no evaluation, no checkpoints, no reporting, a fresh start,
a train-log row per step (the benchmarks time steps from it)."""

QUIET_RUN = dict(
    eval_fraction=0.0,
    logging_steps=1,
    save_steps=10**9,
    save_final=False,
    report_to="none",
    resume="never",
)
