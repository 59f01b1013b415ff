"""What a run tells people: step counting and the train log, W&B, Discord, and the profiler."""
