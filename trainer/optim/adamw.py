"""AdamW, as Hugging Face's `adamw_torch`: two moments per weight. With Kahan-compensated bf16 updates,
torch-optimi's AdamW (its moments in the weights' dtype); otherwise torch's (fused on a GPU)."""

from __future__ import annotations

import logging
from typing import Any

from trainer.optim.spec import OptimizerSpec

log = logging.getLogger(__name__)


class AdamW(OptimizerSpec):
    name = "adamw"
    help = "adamw (as Hugging Face)"
    hf_names = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused")

    def state_bytes(self, shape: Any, weight_bytes: int, lora: Any = None, shards: int = 1) -> int:
        if lora is not None:
            return 2 * 4 * shape.lora_num_params(lora)  # fp32 adapters, fp32 moments
        return 2 * shape.sharded_params(shards) * weight_bytes  # exp_avg and exp_avg_sq in the weights' dtype

    def checkpoint_bytes_per_param(self, weight_bytes: int) -> float:
        return 2 * weight_bytes

    def build(self, params: list, cfg: Any, device: Any, update: str) -> Any:
        import torch

        betas = (cfg.adam_beta1, cfg.adam_beta2)
        common = dict(lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
        if update == "kahan":
            import optimi

            log.info("optimizer: torch-optimi AdamW with Kahan-compensated bf16 updates")
            return optimi.AdamW(params, **common, kahan_sum=True)
        fused = device.type == "cuda"
        optimizer = torch.optim.AdamW(params, **common, fused=fused or None, foreach=None if fused else True)
        low_precision = params[0].dtype in (torch.bfloat16, torch.float16)
        what = "naive bf16 updates" if low_precision else f"{params[0].dtype} weights"
        log.info("optimizer: torch AdamW (%s), %s", "fused" if fused else "foreach", what)
        return optimizer


ADAMW = AdamW()
