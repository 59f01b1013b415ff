"""Library output (transformers, huggingface_hub) through the trainer's own logging: one format, secrets
masked (trainer.infra.redact filters the root logger's handlers), each line once, no progress bars outside a
terminal."""

from __future__ import annotations

import logging
import sys


def route_library_output() -> None:
    """Drop the stderr handlers transformers and huggingface_hub install for themselves, so that their log
    records reach the root logger's handlers only (a handler of their own printed every warning a second
    time, raw and unmasked), and turn their progress bars off outside a terminal (`docker compose logs`
    would show each bar as one endless line)."""
    import huggingface_hub  # noqa: F401  (its handler is installed on import)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hub = logging.getLogger("huggingface_hub")
    for handler in [h for h in hub.handlers if type(h) is logging.StreamHandler]:
        hub.removeHandler(handler)
    hub.propagate = True
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
