"""Weights & Biases logging that never stops training.

`WandbLogger` wraps one W&B run. `wandb` is imported lazily (it is slow to import). Without an API key (and
not logged in) the run is offline, said once. Any failure in init or log is logged once and W&B is switched
off for the rest of the run; training goes on.

Model artifacts follow `WANDB_LOG_MODEL` as in Hugging Face's WandbCallback (`log_model_mode`): `end` logs
final/ at the end, `checkpoint` also each checkpoint as it is saved. An artifact holds the model's files
(weights, config, tokenizer, prompt template, model card: `MODEL_FILE_PATTERNS`), never the optimizer or the
trainer state. Offline, wandb keeps a staged copy of each file in `WANDB_DATA_DIR` (default
~/.local/share/wandb) until `wandb sync` uploads it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from trainer.infra.redact import redact, redact_obj

logger = logging.getLogger(__name__)

DEFAULT_PROJECT = "recipe-t5"
STEP_KEY = "train/global_step"
SAMPLE_COLUMNS = [
    "step",
    "prompt",
    "generated",
    "reference",
    "rougeL",
    "ingredient_coverage",
    "invented_ingredients",
    "structure",
]
LOG_MODEL_ENV = "WANDB_LOG_MODEL"
LOG_MODEL_MODES = ("false", "end", "checkpoint")
# A model directory's files that make up a model artifact: what from_pretrained, `trainer generate` and a
# reader need; not dcp/ (optimizer states), trainer_state.json, scheduler.pt or rng*.pt (resume state).
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "spiece.model",
    "recipe_template.json",
    "README.md",
    "adapter_config.json",  # a LoRA checkpoint's adapter (trainer.model.lora)
    "adapter/*",  # a LoRA run's final/adapter/
)
# Set (with WANDB_MODE=offline) by the test suite to skip wandb's system-metrics sampler and machine
# metadata, which cost seconds per run. Real runs keep system metrics: they are what the user watches.
FAST_TEST_ENV = "TRAINER_WANDB_FAST_TEST"
# Config keys that could hold a secret in a future config version: never sent even if a value is set.
_SECRET_KEY_PARTS = ("token", "api_key", "apikey", "webhook", "password", "secret")
_MAX_LOG_FAILURES = 20


def has_wandb_credentials() -> bool:
    """True if WANDB_API_KEY is set or `wandb login` stored a key for the configured host."""
    if os.environ.get("WANDB_API_KEY", "").strip() or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return bool(read_netrc_auth(host=host))
    except Exception:
        pass
    try:  # wandb moved its helpers before; fall back to reading ~/.netrc ourselves
        import netrc
        import urllib.parse

        name = urllib.parse.urlparse(host).hostname or host
        return netrc.netrc(os.environ.get("NETRC")).authenticators(name) is not None
    except Exception:
        return False


def log_model_mode() -> str:
    """WANDB_LOG_MODEL as Hugging Face reads it: "false" (unset), "end" or "checkpoint". "true" (or 1, yes,
    on) means "end", as in transformers 4.x (transformers 5 ignores it); anything else is "false", said."""
    raw = os.environ.get(LOG_MODEL_ENV, "").strip()
    value = raw.lower() or "false"
    if value in LOG_MODEL_MODES:
        return value
    if value in ("true", "1", "yes", "on"):
        logger.info("%s=%s read as `end` (the final model); use end or checkpoint", LOG_MODEL_ENV, raw)
        return "end"
    logger.warning("%s=%r is not false, end or checkpoint: no model is logged to W&B", LOG_MODEL_ENV, raw)
    return "false"


def model_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The files of `model_dir` a model artifact holds (`MODEL_FILE_PATTERNS`), sorted."""
    found = {p for pattern in MODEL_FILE_PATTERNS for p in Path(model_dir).glob(pattern) if p.is_file()}
    return sorted(found)


def artifact_name(run_name: str | None, run_id: str) -> str:
    """`model-<run name>` (`model-<run id>` without one), as Hugging Face names it; characters W&B refuses in
    an artifact name become "-"."""
    return "model-" + re.sub(r"[^\w.-]", "-", run_name or run_id)


def clean_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as sent to W&B: secret-looking keys dropped, every string value redacted."""
    out = {}
    for key, value in config.items():
        if any(part in key.lower() for part in _SECRET_KEY_PARTS):
            continue
        out[key] = redact_obj(value)
    return out


class WandbLogger:
    """One W&B run. Methods never raise; after the first failure W&B is off and that is logged once."""

    def __init__(
        self,
        *,
        config: dict[str, Any],
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        run_id: str | None = None,
        directory: str | None = None,
    ):
        self.run: Any = None
        self.mode: str | None = None
        self._wandb: Any = None
        self._failures = 0
        self._failed_logged = False
        try:
            self._init(config, project, entity, name, run_id, directory)
        except Exception as e:
            self._fail("init", e)

    # -- setup -------------------------------------------------------------------------------------

    def _settings(self, mode: str) -> Any:
        wandb = self._wandb
        kwargs: dict[str, Any] = {}
        if not os.environ.get("WANDB_INIT_TIMEOUT"):
            kwargs["init_timeout"] = 60.0  # wandb's default is 90 s of a stalled start
        if os.environ.get(FAST_TEST_ENV) and mode == "offline":
            kwargs.update(
                console="off", x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True
            )
        fields = getattr(wandb.Settings, "model_fields", None)
        if fields is not None:  # settings renamed across wandb versions: pass only what this one knows
            kwargs = {k: v for k, v in kwargs.items() if k in fields}
        return wandb.Settings(**kwargs)

    def _init(self, config, project, entity, name, run_id, directory) -> None:
        mode = os.environ.get("WANDB_MODE", "").strip().lower() or None
        if mode == "disabled":
            logger.info("W&B disabled (WANDB_MODE=disabled)")
            return
        if mode in (None, "online") and not has_wandb_credentials():
            logger.warning(
                "W&B: no WANDB_API_KEY and not logged in; logging offline (sync later: wandb sync)"
            )
            mode = "offline"
        mode = mode or "online"
        import wandb

        self._wandb = wandb
        if directory:
            os.makedirs(directory, exist_ok=True)
        run_id = run_id or os.environ.get("WANDB_RUN_ID") or None
        kwargs = dict(
            project=project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            entity=entity or os.environ.get("WANDB_ENTITY") or None,
            name=name or os.environ.get("WANDB_NAME") or None,
            id=run_id,
            resume="allow" if run_id else None,
            config=clean_config(config),
            dir=directory,
            mode=mode,
            reinit="finish_previous",
        )
        try:
            self.run = wandb.init(**kwargs, settings=self._settings(mode))
        except Exception as e:
            if mode != "online":
                raise
            # Network down or W&B unreachable at start: keep the metrics locally rather than losing them.
            logger.warning("W&B: online init failed (%s); logging offline instead", redact(str(e))[:300])
            self.run = wandb.init(**{**kwargs, "mode": "offline"}, settings=self._settings("offline"))
            mode = "offline"
        self.mode = mode
        # Plot against the optimizer step, not wandb's internal counter: after a resume from an older
        # checkpoint the steps repeat, which wandb's own `step=` would silently drop.
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        logger.info("W&B run %s (%s)%s", self.run.id, mode, f": {self.run.url}" if mode == "online" else "")

    # -- logging -----------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.run is not None

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    @property
    def url(self) -> str | None:
        try:
            return self.run.url if self.run is not None and self.mode == "online" else None
        except Exception:
            return None

    def _fail(self, where: str, e: BaseException) -> None:
        self._failures += 1
        if not self._failed_logged:
            self._failed_logged = True
            logger.warning(
                "W&B %s failed, training goes on: %s: %s", where, type(e).__name__, redact(str(e))[:500]
            )
        if where == "init" or self._failures >= _MAX_LOG_FAILURES:
            if self.run is not None and where != "init":
                logger.warning("W&B: %d failures, W&B is off for the rest of this run", self._failures)
            self.run = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log({**metrics, STEP_KEY: step})
            self._failures = 0
        except Exception as e:
            self._fail("log", e)

    def log_samples(self, step: int, samples: list[dict[str, Any]], key: str = "eval/generations") -> None:
        """A table of generated recipes (SAMPLE_COLUMNS): prompt, generated, reference and their scores."""
        if self.run is None or not samples:
            return
        try:
            table = self._wandb.Table(columns=SAMPLE_COLUMNS)
            for sample in samples:
                row = [step] + [sample.get(column) for column in SAMPLE_COLUMNS[1:]]
                table.add_data(*(redact(v) if isinstance(v, str) else v for v in row))
            self.run.log({key: table, STEP_KEY: step})
        except Exception as e:
            self._fail("log", e)

    def log_model(
        self, model_dir: str | os.PathLike[str], name: str, aliases: list[str], metadata: dict[str, Any]
    ) -> bool:
        """Log the model files of `model_dir` (`model_files`) as a version of the model artifact `name`, with
        `aliases` and `metadata` (redacted). Returns whether it was logged."""
        if self.run is None:
            return False
        try:
            artifact = self._wandb.Artifact(name=name, type="model", metadata=redact_obj(metadata))
            for path in model_files(model_dir):
                artifact.add_file(str(path), name=path.relative_to(model_dir).as_posix())
            self.run.log_artifact(artifact, aliases=aliases)
            return True
        except Exception as e:
            self._fail("log_artifact", e)
            return False

    def set_summary(self, values: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            for k, v in values.items():
                self.run.summary[k] = redact_obj(v)
        except Exception as e:
            self._fail("summary", e)

    def mark_preempting(self) -> None:
        if self.run is None:
            return
        try:
            self.run.mark_preempting()
        except Exception as e:
            self._fail("mark_preempting", e)

    def finish(self, exit_code: int = 0) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:
            if not self._failed_logged:
                logger.warning("W&B finish failed: %s: %s", type(e).__name__, redact(str(e))[:500])
