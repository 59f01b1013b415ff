"""push_to_hub: the model, and by `hub_strategy` its checkpoints, uploaded to the Hugging Face Hub while the
run trains, from a background thread, with huggingface_hub (`create_repo`, `upload_folder`).

What is uploaded when (Seq2SeqTrainer's `hub_strategy`, the same meanings):

- `end`: final/ (weights, tokenizer, prompt template, model card) to the repository's root, at the end;
- `every_save`: also, at each checkpoint, its model files (weights, config, tokenizer, prompt template) to
  the root;
- `checkpoint`: also the whole newest checkpoint (optimizer state included) to `last-checkpoint/`, to
  resume from anywhere;
- `all_checkpoints`: also each checkpoint, whole, to its own `checkpoint-<step>/`.

A save is staged at once in `<output_dir>/hub-pending/<name>/`: the files hard-linked (no copy, and kept
when save_total_limit rotates the checkpoint away) in the repository's layout under `tree/`, and
`upload.json` saying the commit. The thread uploads one staged save at a time; a newer save replaces one that
is still waiting (under all_checkpoints it takes the waiting checkpoint folders along: every checkpoint is
uploaded, in one commit). A staged save is removed once uploaded, so what is in hub-pending/ is what is not
on the Hub yet: a restarted run uploads it first, and a run that is already finished uploads it and exits.

Every request to the Hub times out once it waits `hub_request_timeout` for bytes (huggingface_hub's own
requests have no timeout: a Hub that accepts a connection and never answers would hold the upload thread for
the rest of the run, unseen). A failed upload (an error, a refusal, a stall) is tried again after each wait
of `hub_retry_waits` (5 s and 30 s by default), then logged once and said in Discord, during the run, and
waits for the next save (it goes in that commit) or the next run; training never waits on the network. At
the end the last upload gets `hub_upload_timeout`; what is not done then is said in one line, with the
command that finishes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shlex
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainer.checkpoint.model_card import write_model_card
from trainer.config import ConfigError, TrainConfig
from trainer.data.prompt import TEMPLATE_FILE
from trainer.infra.disk import write_text_atomic
from trainer.infra.redact import redact

log = logging.getLogger(__name__)

PENDING_DIR = "hub-pending"
UPLOAD_FILE = "upload.json"  # written last: a staged save without it is incomplete, and removed
# A checkpoint's files that make the model usable on their own (no optimizer state): every_save's upload.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "spiece.model",
    TEMPLATE_FILE,
    "adapter_config.json",  # a LoRA run's checkpoints hold its adapter (trainer.model.lora), PEFT's format
)
# What a LoRA run's checkpoints leave at the root, which its final/ (the merged model, the adapter in
# adapter/) replaces: from_pretrained would otherwise take the root for an adapter.
ADAPTER_ROOT_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def time_out_hub_requests(timeout_s: float) -> None:
    """Make every request huggingface_hub sends from this process fail after `timeout_s` without a byte
    (connecting: at most 30 s), instead of waiting forever: its client, made by its own factory, with a
    timeout."""
    import huggingface_hub
    from huggingface_hub.utils import _http  # the factory huggingface_hub makes its client with

    def client_with_timeouts():
        client = _http.default_client_factory()
        client.timeout = type(client.timeout)(timeout_s, connect=min(timeout_s, 30.0))
        return client

    huggingface_hub.set_client_factory(client_with_timeouts)


def repo_name(cfg: TrainConfig) -> str:
    """The repository asked for: hub_model_id, else output_dir's name (in the token's namespace), as in HF."""
    return cfg.hub_model_id or Path(cfg.output_dir).absolute().name


def check_hub_config(cfg: TrainConfig) -> None:
    """ConfigError before any work for a push_to_hub that cannot upload: no token, offline mode, or a
    repository name the Hub refuses."""
    if not cfg.push_to_hub:
        return
    from huggingface_hub import constants, get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if get_token() is None:
        raise ConfigError(
            "push_to_hub needs a Hugging Face token with write access in HF_TOKEN (in .env for Docker; "
            "https://huggingface.co/settings/tokens), or set push_to_hub: false",
            key="push_to_hub",
        )
    if constants.HF_HUB_OFFLINE:
        raise ConfigError("push_to_hub: HF_HUB_OFFLINE is set, so nothing can be uploaded", key="push_to_hub")
    name = repo_name(cfg)
    try:
        validate_repo_id(name)
    except HFValidationError as e:
        key = "hub_model_id" if cfg.hub_model_id else "output_dir"
        raise ConfigError(f"push_to_hub: {name!r} is not a Hub repository name ({e})", key=key) from None


@dataclass
class StagedUpload:
    """One commit waiting in hub-pending/: `path/tree` in the repository's layout, `path/upload.json`."""

    path: Path
    step: int
    message: str
    final: bool = False
    delete_patterns: list[str] = field(default_factory=list)
    ready: bool = True  # False: it failed; it goes again with the next save, at the end, or the next run

    @property
    def tree(self) -> Path:
        return self.path / "tree"

    @property
    def what(self) -> str:
        return "final/" if self.final else f"the checkpoint of step {self.step:,}"

    def save(self) -> None:
        record = {"step": self.step, "message": self.message, "final": self.final}
        write_text_atomic(self.path / UPLOAD_FILE, json.dumps(record | {"delete": self.delete_patterns}))

    @classmethod
    def load(cls, path: Path) -> StagedUpload:
        record = json.loads((path / UPLOAD_FILE).read_text(encoding="utf-8"))
        return cls(path, record["step"], record["message"], record["final"], record["delete"])

    def absorb(self, older: StagedUpload) -> None:
        """Take over a waiting, older upload: its folders this one lacks move into this commit
        (all_checkpoints uploads every checkpoint; final/ takes the newest checkpoint's last-checkpoint/
        along); its root files are this one's."""
        for folder in sorted(p for p in older.tree.iterdir() if p.is_dir()):
            if not (self.tree / folder.name).exists():
                os.rename(folder, self.tree / folder.name)
        self.delete_patterns = sorted(set(self.delete_patterns) | set(older.delete_patterns))
        self.save()
        shutil.rmtree(older.path, ignore_errors=True)

    def finish_command(self, repo_id: str) -> str:
        """The command that uploads this commit by hand."""
        words = ["hf", "upload", repo_id, str(self.tree), ".", "--commit-message", self.message]
        for pattern in self.delete_patterns:
            words += ["--delete", pattern]
        return shlex.join(words)


class HubUploader:
    """Uploads the run's saves to the Hub from a daemon thread (see the module docstring). Rank 0 only.

    uploader = HubUploader(cfg, output_dir, reporter)   # uploads what an earlier run left pending
    uploader.checkpoint_saved(path, step)               # after each checkpoint (never waits)
    uploader.final_saved(final, step, card_info)        # after final/
    uploader.wait(cfg.hub_upload_timeout_s)             # at the end: the last upload, bounded
    uploader.close()                                    # leaves what is not uploaded pending
    """

    def __init__(self, cfg: TrainConfig, output_dir: str | os.PathLike[str], reporter=None):
        from huggingface_hub import HfApi
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # the thread's bars would tear the training's progress bar and log apart
        time_out_hub_requests(cfg.hub_request_timeout_s)
        self.cfg = cfg
        self.pending_dir = Path(output_dir) / PENDING_DIR
        self.reporter = reporter
        self.requested = repo_name(cfg)
        self.repo_id: str | None = None  # as the Hub names it (with the namespace), once created
        self.api = HfApi()
        self.failures = 0
        self._queued: StagedUpload | None = None
        self._active: StagedUpload | None = None
        self._closing = False
        self._deadline: float | None = None
        self._cond = threading.Condition()
        self._copied_warned = False
        self._resume_pending()
        log.info(
            "push_to_hub: to the Hub repository %s at %s (hub_strategy %s), from a background thread",
            self.requested,
            self.api.endpoint,
            cfg.hub_strategy,
        )
        self._thread = threading.Thread(target=self._run, name="hub-uploader", daemon=True)
        self._thread.start()

    # -- the training loop's side ------------------------------------------------------------------

    def checkpoint_saved(self, checkpoint: Path, step: int) -> None:
        """Stage what hub_strategy uploads of `checkpoint` (nothing under `end`); returns at once."""
        strategy = self.cfg.hub_strategy
        if strategy == "end":
            return
        parts: list[tuple[Path, str, bool]] = [(checkpoint, "", True)]
        delete = []
        if strategy == "checkpoint":
            parts.append((checkpoint, "last-checkpoint", False))
            delete = ["last-checkpoint/*"]  # files of an older checkpoint that this one does not have
        elif strategy == "all_checkpoints":
            parts.append((checkpoint, checkpoint.name, False))
        self._stage(f"step-{step}", step, f"Training in progress, step {step}", parts, delete)

    def final_saved(self, final: Path, step: int, card=None) -> None:
        """Stage final/ for the root of the repository, its model card (`card`, a ModelCardInfo) written
        for the Hub: how to download the model from there."""
        parts = [(final, "", False)]
        delete = ADAPTER_ROOT_FILES if (final / "adapter").is_dir() else []
        staged = self._stage("final", step, "End of training", parts, delete, final=True, card=card)
        if staged is not None:
            log.info("push_to_hub: final/ (step %d) is queued for %s", step, self._url())

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the uploads to finish (a failed one is tried once more); True when
        everything is on the Hub. What is left is said in one line, with how to finish it."""
        start = time.monotonic()
        with self._cond:
            self._deadline = start + timeout_s
            if self._queued is not None:
                self._queued.ready = True
            self._cond.notify_all()
            while self._active is not None or (self._queued is not None and self._queued.ready):
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            left_over = [u for u in (self._active, self._queued) if u is not None]
        waited = time.monotonic() - start
        if not left_over:
            log.info("push_to_hub: everything is uploaded to %s (the end waited %.1f s)", self._url(), waited)
            return True
        repo = self.repo_id or self.requested
        for upload in left_over:
            log.warning(
                "push_to_hub: %s is not on the Hub (hub_upload_timeout %s, waited %.1f s); its files wait in "
                "%s. Running the same command again uploads it, or: %s",
                upload.what,
                self.cfg.hub_upload_timeout,
                waited,
                upload.path,
                upload.finish_command(repo),
            )
        if self.reporter is not None and self.failures == 0:  # a failure was said already
            self.reporter.hub_push_failed(
                what=left_over[0].what,
                error=f"not finished within hub_upload_timeout {self.cfg.hub_upload_timeout}",
                pending=str(left_over[0].path),
            )
        return False

    def close(self) -> None:
        """Stop the thread (an upload in flight ends with the process); what is not uploaded stays pending."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    # -- staging ---------------------------------------------------------------------------------

    def _stage(
        self,
        name: str,
        step: int,
        message: str,
        parts: list[tuple[Path, str, bool]],
        delete: list[str],
        final: bool = False,
        card=None,
    ) -> StagedUpload | None:
        """Link the files of `parts` ((source directory, folder in the repository, model files only)) into
        a new staged upload and queue it, replacing the one waiting. Never raises: a staging error (a full
        disk) is logged and that save is not uploaded."""
        path = self.pending_dir / f"{name}-{secrets.token_hex(3)}"
        tmp = path.with_name(path.name + ".tmp")
        upload = StagedUpload(path, step, message, final, delete)
        try:
            tmp.mkdir(parents=True)
            for source, folder, model_only in parts:
                self._link_tree(source, tmp / "tree" / folder, model_only)
            if card is not None:
                (tmp / "tree" / "README.md").unlink(missing_ok=True)  # final/'s, linked: not written through
                write_model_card(tmp / "tree", replace(card, repo_id=self.repo_id or self.requested))
            os.rename(tmp, path)
            upload.save()
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
            log.warning("push_to_hub: could not stage %s for upload, it is skipped: %s", name, redact(str(e)))
            return None
        self._queue(upload)
        return upload

    def _link_tree(self, source: Path, out: Path, model_only: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if model_only:
            files = [source / n for n in MODEL_FILES if (source / n).is_file()]
            files += sorted(source.glob("*.safetensors"))
        else:
            files = sorted(p for p in source.rglob("*") if p.is_file())
        for src in files:
            dst = out / src.relative_to(source)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # a filesystem without hard links: a copy, said once
                if not self._copied_warned:
                    self._copied_warned = True
                    log.warning("push_to_hub: %s has no hard links; saves are copied for upload", out)
                shutil.copy2(src, dst)

    def _queue(self, upload: StagedUpload) -> None:
        with self._cond:
            if self._queued is not None:
                upload.absorb(self._queued)
            self._queued = upload
            self._cond.notify_all()

    def _resume_pending(self) -> None:
        """Queue what an earlier run staged and did not upload (oldest absorbed into newest); remove what it
        left half-staged."""
        if not self.pending_dir.is_dir():
            return
        found = []
        for path in sorted(self.pending_dir.iterdir()):
            if path.is_dir() and (path / UPLOAD_FILE).is_file() and not path.name.endswith(".tmp"):
                found.append(StagedUpload.load(path))
            else:
                shutil.rmtree(path, ignore_errors=True)
        found.sort(key=lambda u: (u.final, u.step))
        if found:
            log.info(
                "push_to_hub: %d upload(s) an earlier run left unfinished go first: %s",
                len(found),
                ", ".join(u.what for u in found),
            )
        for upload in found:
            self._queue(upload)

    # -- the thread ------------------------------------------------------------------------------

    def _url(self) -> str:
        return f"{self.api.endpoint}/{self.repo_id or self.requested}"

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            self._ensure_repo()  # early: a bad token or name shows at the start, not at the first save
        while True:
            with self._cond:
                while not self._closing and (self._queued is None or not self._queued.ready):
                    self._cond.wait()
                if self._closing:
                    return
                upload, self._queued, self._active = self._queued, None, self._queued
            done = self._upload(upload)
            with self._cond:
                self._active = None
                if done:
                    shutil.rmtree(upload.path, ignore_errors=True)
                    with contextlib.suppress(OSError):  # empty: nothing waits
                        self.pending_dir.rmdir()
                else:
                    upload.ready = False
                    if self._queued is not None:  # a newer save came meanwhile: this one goes with it
                        self._queued.absorb(upload)
                    else:
                        self._queued = upload
                self._cond.notify_all()

    def _ensure_repo(self) -> str:
        if self.repo_id is None:
            url = self.api.create_repo(self.requested, private=self.cfg.hub_private_repo, exist_ok=True)
            self.repo_id = url.repo_id
        return self.repo_id

    def _upload(self, upload: StagedUpload) -> bool:
        """Commit one staged upload, tried again after each of hub_retry_waits; a failure is logged once a run
        and said in Discord."""
        error: Exception | None = None
        for attempt, wait in enumerate([0.0, *self.cfg.hub_retry_waits_s]):
            if attempt > 0 and not self._sleep(wait):
                break
            started = time.monotonic()
            try:
                repo_id = self._ensure_repo()
                info = self.api.upload_folder(
                    repo_id=repo_id,
                    folder_path=upload.tree,
                    commit_message=upload.message,
                    delete_patterns=upload.delete_patterns or None,
                )
            except Exception as e:  # the network, the Hub, the token: never the training's problem
                error = e
                log.debug("push_to_hub: try %d of %s failed", attempt + 1, upload.what, exc_info=True)
                continue
            log.info(
                "push_to_hub: uploaded %s to %s in %.0f s (%s)",
                upload.what,
                self._url(),
                time.monotonic() - started,
                getattr(info, "commit_url", info),
            )
            if upload.final and self.reporter is not None:
                self.reporter.hub_pushed(url=self._url(), step=upload.step)
            return True
        self._failed(upload, error)
        return False

    def _failed(self, upload: StagedUpload, error: Exception | None) -> None:
        self.failures += 1
        text = redact(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        if self.failures > 1:
            log.debug("push_to_hub: %s failed again: %s", upload.what, text)
            return
        log.warning(
            "push_to_hub: uploading %s to %s failed (%s); training goes on. It is tried again with the next "
            "save and at the end, and a later run uploads it (its files wait in %s). Further upload failures "
            "are not logged.",
            upload.what,
            self._url(),
            text,
            self.pending_dir,
        )
        if self.reporter is not None:
            self.reporter.hub_push_failed(what=upload.what, error=text, pending=str(self.pending_dir))

    def _sleep(self, seconds: float) -> bool:
        """Sleep before a retry; False (at once) when closing, or when the end's deadline comes first."""
        with self._cond:
            end = time.monotonic() + seconds
            while not self._closing:
                if self._deadline is not None and self._deadline < end:
                    return False
                left = end - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
            return False


def upload_pending(cfg: TrainConfig, output_dir: str | os.PathLike[str]) -> bool:
    """For a run that is already finished: upload what an earlier run left pending, waiting up to
    hub_upload_timeout. True when nothing is left."""
    if not cfg.push_to_hub or not (Path(output_dir) / PENDING_DIR).is_dir():
        return True
    uploader = HubUploader(cfg, output_dir)
    try:
        return uploader.wait(cfg.hub_upload_timeout_s)
    finally:
        uploader.close()
