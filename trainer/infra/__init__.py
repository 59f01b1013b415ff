"""Plumbing every layer may use: files on disk, logs, secrets, signals, the output_dir lock, the heartbeat,
GPU memory settings and the process group. Imports only trainer.config."""
