"""The trainer's command line with faults a 32 GB card meets on a multi-day run, injected into a real run with
torch's global module hooks (the loop under test is unchanged): a CUDA out-of-memory error on one training
micro-batch, NaN activations on others, optionally an error whose message carries every secret (as some
library errors carry URLs and tokens), and optionally a slower step.

    python tests/run_with_faults.py train --config CONFIG            # one process
    torchrun --nproc_per_node=2 tests/run_with_faults.py train ...   # FAULT_RANK: which rank injects

Environment: FAULT_OOM_AT, FAULT_CRASH_AT (the n-th training micro-batch of this process, from 1),
FAULT_NAN_AT (a comma-separated list of them), FAULT_NAN_FROM (every one from there on), FAULT_STEP_SLEEP_S
(seconds added to each micro-batch), FAULT_RANK (only the process of this torchrun RANK injects; default:
every process).
"""

import os
import sys
import time

import torch
from torch.nn.modules import module as nn_module

from trainer.cli import main

STEP_SLEEP_S = float(os.environ.get("FAULT_STEP_SLEEP_S", 0))  # a slower step, of known duration at least
OOM_AT = int(os.environ.get("FAULT_OOM_AT", 0))
NAN_AT = {int(x) for x in os.environ.get("FAULT_NAN_AT", "").split(",") if x}
NAN_FROM = int(os.environ.get("FAULT_NAN_FROM", 0))
CRASH_AT = int(os.environ.get("FAULT_CRASH_AT", 0))
INJECTS = os.environ.get("FAULT_RANK") in (None, os.environ.get("RANK", "0"))
forwards = 0


def encoder_in_training(module):
    # The encoder runs once per training micro-batch, whichever way the loop computes its loss.
    return module.training and type(module).__name__ == "T5Stack" and not module.is_decoder


def pre_hook(module, args):
    global forwards
    if not encoder_in_training(module):
        return None
    forwards += 1
    time.sleep(STEP_SLEEP_S)
    if forwards == OOM_AT:
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
    if forwards == CRASH_AT:
        secrets = [os.environ.get(n, "") for n in ("WANDB_API_KEY", "HF_TOKEN", "DISCORD_WEBHOOK_URL")]
        raise RuntimeError("upstream call failed: " + " ".join(secrets))
    return None


def post_hook(module, args, output):
    if encoder_in_training(module) and (forwards in NAN_AT or (NAN_FROM and forwards >= NAN_FROM)):
        output.last_hidden_state = output.last_hidden_state * float("nan")
    return output


if __name__ == "__main__":
    if INJECTS:
        nn_module.register_module_forward_pre_hook(pre_hook)
        nn_module.register_module_forward_hook(post_hook)
    sys.exit(main(sys.argv[1:]))
