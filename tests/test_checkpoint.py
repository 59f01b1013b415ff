"""Checkpoints: atomic writes, rotation that keeps the best, resume picks the newest complete one."""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

from trainer.checkpoint import store as ckpt
from trainer.checkpoint.resume import find_resume_checkpoint
from trainer.config import ConfigError


def _setup():
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def _save(out, step, model, opt, sched, **state):
    return ckpt.save_checkpoint(out, step, model=model, optimizer=opt, scheduler=sched, trainer_state=state)


def test_save_and_restore_round_trip(tmp_path):
    model, opt, sched = _setup()
    x = torch.randint(2, 64, (2, 5))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    sched.step()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    path = _save(tmp_path, 7, model, opt, sched, data_position={"epoch": 0, "batches_done": 7})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())

    assert path == tmp_path / "checkpoint-7" and not list(tmp_path.glob("*.tmp-*"))
    assert (path / "model.safetensors").is_file()
    loaded = AutoModelForSeq2SeqLM.from_pretrained(path)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    _, opt2, sched2 = _setup()
    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))
    ckpt.load_training_state(path, loaded, opt2, sched2)
    assert sched2.last_epoch == 1
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    state = ckpt.load_trainer_state(path)
    assert state["step"] == 7 and state["data_position"] == {"epoch": 0, "batches_done": 7}


def test_incomplete_checkpoints_are_never_picked(tmp_path):
    model, opt, sched = _setup()
    _save(tmp_path, 10, model, opt, sched)
    # A save killed mid-write: a temporary dir, and a renamed dir without its completion marker.
    (tmp_path / "checkpoint-30.tmp-99999").mkdir()
    broken = tmp_path / "checkpoint-20"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"partial")
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "checkpoint-10"
    assert find_resume_checkpoint("never", tmp_path) is None
    assert find_resume_checkpoint("auto", tmp_path / "nothing-here") is None
    with pytest.raises(ConfigError, match="checkpoint-20 is not a usable checkpoint"):
        find_resume_checkpoint(str(broken), tmp_path)


def _truncate(path, size=10):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_resuming_with_another_optimizer_or_kahan_buffer_is_one_line_before_any_loading(tmp_path):
    """The optimizer's saved states fit one optimizer and one way of keeping bf16 weights' Kahan buffer: a
    config that changes either is refused naming the key (loading would fail deep in DCP on the missing
    states); fp32 weights keep no buffer, so bf16_update may change with them."""
    from trainer.checkpoint.resume import check_resume_config

    checkpoint = tmp_path / "checkpoint-6"
    saved = {"optimizer": "adafactor", "bf16_update": "kahan", "dtype": "bfloat16", "adapter": None}
    check_resume_config(checkpoint, saved, dict(saved, learning_rate=1e-4))  # other keys: a warning only
    with pytest.raises(
        ConfigError, match=r"checkpoint-6 was written with bf16_update 'kahan', .* changes to 'kahan_8bit'"
    ):
        check_resume_config(checkpoint, saved, dict(saved, bf16_update="kahan_8bit"))
    with pytest.raises(ConfigError, match=r"written with optimizer 'adafactor', .* changes to 'adamw'"):
        check_resume_config(checkpoint, saved, dict(saved, optimizer="adamw"))
    fp32 = dict(saved, dtype="float32")
    check_resume_config(checkpoint, fp32, dict(fp32, bf16_update="naive"))


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: (p / "model.safetensors").write_bytes(b""),
        lambda p: _truncate(p / "model.safetensors", 100),
        lambda p: next((p / "dcp").glob("*.distcp")).unlink(),
        lambda p: _truncate(next((p / "dcp").glob("*.distcp")), 64),
        lambda p: _truncate(p / "scheduler.pt"),
        lambda p: _truncate(p / ckpt.MARKER, 20),
        lambda p: (p / "rng.pt").unlink(),
        lambda p: (p / ckpt.MARKER).unlink(),
    ],
    ids=[
        "empty-weights",
        "cut-weights",
        "no-dcp-data",
        "cut-dcp-data",
        "cut-scheduler",
        "cut-state",
        "no-rng",
        "no-marker",
    ],  # fmt: skip
)
def test_resume_auto_falls_back_past_a_damaged_checkpoint(tmp_path, caplog, damage):
    model, opt, sched = _setup()
    _save(tmp_path, 3, model, opt, sched)
    newest = _save(tmp_path, 6, model, opt, sched)
    assert find_resume_checkpoint("auto", tmp_path) == newest
    damage(newest)
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "checkpoint-3"
    assert "skipping" in caplog.text and "checkpoint-6" in caplog.text
    if (newest / ckpt.MARKER).is_file():
        with pytest.raises(ConfigError, match="checkpoint-6 is not a usable checkpoint"):
            find_resume_checkpoint(str(newest), tmp_path)


def test_rotation_keeps_the_last_n_and_the_best(tmp_path):
    model, opt, sched = _setup()
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, model, opt, sched)
    ckpt.rotate_checkpoints(tmp_path, 2, best=tmp_path / "checkpoint-2")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    assert json.loads((tmp_path / "checkpoint-5" / ckpt.MARKER).read_text())["step"] == 5


def test_what_a_killed_save_left_is_removed_and_nothing_else(tmp_path):
    model, opt, sched = _setup()
    _save(tmp_path, 1, model, opt, sched)
    for name in ("checkpoint-2.tmp-99999", "checkpoint-3.tmp-123", "final.tmp"):  # a run killed mid-save
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "final").mkdir()
    removed = ckpt.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == ["checkpoint-2.tmp-99999", "checkpoint-3.tmp-123", "final.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "final"]
    assert ckpt.remove_stale_temporaries(tmp_path) == []


def _stepped(tmp_path, step):
    """A model after one optimizer step, and its checkpoint-<step> written in the loop under tmp_path/loop."""
    model, opt, sched = _setup()
    x = torch.randint(2, 64, (2, 5))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return model, opt, sched, _save(tmp_path / "loop", step, model, opt, sched, note="same")


def _gathered(tmp_path, step, model, opt, sched):
    """checkpoint-<step>'s contents for tmp_path/background, holding the same trainer state as _stepped's."""
    return ckpt.gather_checkpoint(
        tmp_path / "background",
        step,
        model=model,
        optimizer=opt,
        scheduler=sched,
        trainer_state={"note": "same"},
    )


def test_a_background_write_holds_the_state_of_its_step_and_is_the_same_checkpoint(tmp_path):
    """The writer copies the state off the model before it returns: the next step may change the weights at
    once, and the checkpoint written meanwhile still holds the step's; file for file it is the checkpoint a
    write in the loop makes."""
    from safetensors.torch import load_file

    from trainer.checkpoint.writer import CheckpointWriter

    model, opt, sched, in_loop = _stepped(tmp_path, 3)
    writer = CheckpointWriter(background=True)
    assert writer.save(_gathered(tmp_path, 3, model, opt, sched)) is True
    with torch.no_grad():  # the next step, while the write may be going on
        for p in model.parameters():
            p.add_(1.0)
    for _ in range(
        6000
    ):  # in flight until the write ends by itself, without the loop looking (5 min at most)
        if writer.in_flight is None:
            break
        assert writer.in_flight == 3
        time.sleep(0.05)
    assert writer.in_flight is None
    writer.wait()
    (done,) = writer.written()
    writer.close()
    assert done.step == 3 and done.path == tmp_path / "background" / "checkpoint-3" and done.seconds >= 0
    files = sorted(p.relative_to(done.path).as_posix() for p in done.path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(in_loop).as_posix() for p in in_loop.rglob("*") if p.is_file())
    ours, theirs = load_file(done.path / "model.safetensors"), load_file(in_loop / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert ckpt.checkpoint_problem(done.path) is None
    restored, opt2, sched2 = _setup()
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    ckpt.load_training_state(
        done.path, restored, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    )
    before = AutoModelForSeq2SeqLM.from_pretrained(in_loop)
    for a, b in zip(restored.state_dict().values(), before.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the step's weights, not the changed ones


def test_host_buffers_reserved_after_the_first_step_are_what_the_first_save_copies_into(tmp_path):
    """The loop reserves the background saves' host buffers after its first step, in a thread beside
    training (pinning 17 GB takes seconds the first save would pause for): that save copies into them, and
    writes the checkpoint a save in the loop writes."""
    from safetensors.torch import load_file

    from trainer.checkpoint.writer import CheckpointWriter

    model, opt, sched, in_loop = _stepped(tmp_path, 1)
    writer = CheckpointWriter(background=True)
    assert writer.wants_buffers
    writer.reserve(ckpt.state_dicts(model, opt))
    assert not writer.wants_buffers
    assert writer.save(_gathered(tmp_path, 1, model, opt, sched)) is True
    reserved = {b.data_ptr() for b in writer._stager._buffers}
    staged = {t.data_ptr() for t in writer._writing.dcp_state["model"].values()}
    assert staged <= reserved  # no buffer allocated anew in the save's pause
    writer.close()
    (done,) = writer.written()
    ours, theirs = (
        load_file(done.path / "model.safetensors"),
        load_file(in_loop / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert ckpt.checkpoint_problem(done.path) is None


@pytest.mark.parametrize("tied", [False, True])
def test_the_weights_a_checkpoint_writes_are_the_files_hugging_face_writes(tmp_path, tied):
    """save_pretrained (what checkpoints and final/ write, through safetensors itself) gives the files
    `model.save_pretrained` gives: the same config.json, generation_config.json, tensor names (a tied weight
    once) and values, from the state dict DCP saves (which names a tied weight under each of its names)."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainer.model.model_files import write_config

    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, tie_word_embeddings=tied
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).to(torch.bfloat16)
    if not tied:  # FLAN-T5's head of its own (transformers 5 ties T5's head whatever the config says)
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight))
    assert (model.lm_head.weight is model.shared.weight) == tied
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    model.save_pretrained(theirs)
    write_config(model, theirs)
    ckpt.save_pretrained(model, ours, get_model_state_dict(model))
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text())
    with safe_open(theirs / "model.safetensors", "pt") as a, safe_open(ours / "model.safetensors", "pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())  # noqa: SIM118
    reloaded = T5ForConditionalGeneration.from_pretrained(ours)
    assert (reloaded.lm_head.weight is reloaded.shared.weight) == tied


def test_without_host_memory_for_the_copy_saves_stay_in_the_loop():
    from trainer.checkpoint.writer import HOST_MEMORY_RESERVE_BYTES, background_saves, tensor_bytes

    gib = 1 << 30
    assert background_saves(10 * gib, 64 * gib) is None
    why = background_saves(10 * gib, 12 * gib)
    assert why is not None and "10.0 GiB" in why and "12.0 GiB free" in why
    assert background_saves(10 * gib, 10 * gib + HOST_MEMORY_RESERVE_BYTES) is None
    assert background_saves(10 * gib, None) is None  # unknown: the copy is tried
    shared = torch.zeros(256)
    assert (
        tensor_bytes({"a": shared, "b": shared.detach(), "c": [torch.zeros(8, dtype=torch.float16)], "n": 3})
        == 1040
    )


def test_staging_copies_the_tensors_to_host_memory_again_at_every_save_into_the_same_buffers():
    """What a background save copies: every tensor into host memory once (a tied weight, one view under two
    names, stays one tensor), the other values as they were (a NumPy scalar among them: torch 2.11's own
    stager failed on such states at the second save). The next save copies its step's values into the same
    buffers."""
    import numpy as np

    from trainer.checkpoint.writer import HostStager

    shared = torch.arange(6.0)
    state = {
        # a model's state dict holds a tied weight as one view per name
        "model": {"shared.weight": shared, "lm_head.weight": shared.detach(), "head": shared[:3]},
        "optim": {
            "state": {"w": {"step": 3, "exp_avg": torch.ones(4)}},
            "param_groups": [{"lr": np.float64(2.5e-4), "eps": (1e-30, 1e-3), "params": ["w"]}],
        },
    }
    stager = HostStager()
    staged = stager.stage(state)
    shared.add_(1.0)  # the next step changes the weights: the staged copy keeps this step's
    assert torch.equal(staged["model"]["shared.weight"], torch.arange(6.0))
    assert staged["model"]["shared.weight"] is staged["model"]["lm_head.weight"]
    assert torch.equal(staged["model"]["head"], torch.arange(3.0))  # another view: its own copy
    group = staged["optim"]["param_groups"][0]
    assert group["lr"] == 2.5e-4 and group["eps"] == (1e-30, 1e-3) and group["params"] == ["w"]
    assert staged["optim"]["state"]["w"]["step"] == 3
    assert torch.equal(staged["optim"]["state"]["w"]["exp_avg"], torch.ones(4))

    again = stager.stage(state)  # the next save
    assert torch.equal(again["model"]["shared.weight"], torch.arange(6.0) + 1.0)
    assert again["model"]["shared.weight"].data_ptr() == staged["model"]["shared.weight"].data_ptr()
    assert again["model"]["shared.weight"].data_ptr() != shared.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked buffers need a GPU")
def test_a_gpu_state_is_staged_into_page_locked_buffers_of_exactly_its_size():
    """XL's staged copy is ~10 GB of page-locked host memory: each buffer is its tensor's size (PyTorch's
    pinned allocator would round each up to a power of two, ~14 GB), page-locked (the copies run at the bus's
    speed), kept from one save to the next, and given back when the stager closes (then made again)."""
    from trainer.checkpoint.writer import HostStager

    def state():
        return {
            "model": OrderedDict(w=torch.randn(3, 1000, device="cuda", dtype=torch.bfloat16)),
            "optim": {"v": torch.randn(5 << 20, device="cuda"), "empty": torch.zeros(0, device="cuda")},
        }

    gpu = state()
    held_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    stager = HostStager()
    stager.reserve(gpu)
    staged = stager.stage(gpu)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == held_before
    for copy, original in (
        (staged["model"]["w"], gpu["model"]["w"]),
        (staged["optim"]["v"], gpu["optim"]["v"]),
    ):
        assert copy.device.type == "cpu" and copy.is_pinned() and torch.equal(copy, original.cpu())
        assert copy.untyped_storage().nbytes() == original.numel() * original.element_size()
    assert staged["optim"]["empty"].numel() == 0
    gpu["model"]["w"].add_(1.0)
    again = stager.stage(gpu)
    assert again["model"]["w"].data_ptr() == staged["model"]["w"].data_ptr()
    assert torch.equal(again["model"]["w"], gpu["model"]["w"].cpu())
    stager.close()
    assert not staged["model"]["w"].is_pinned()  # unregistered: the memory is ordinary again
    another = HostStager()
    copy = another.stage(gpu)["optim"]["v"]
    assert copy.is_pinned()  # pages given back can be locked again
    del another  # a stager dropped without close() unregisters its buffers too
    assert not copy.is_pinned() and torch.equal(copy, gpu["optim"]["v"].cpu())
