"""The offline stand-in for google/flan-t5-xl: Auto classes load it, tokenizes like T5, trains, generates."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

TRICKY_TEXTS = [
    "2 cups flour",
    "1½ cups sugar, ¼ tsp. salt and 1/2 c. crème fraîche",
    "Preheat oven to 350°F (175°C).  Don't   overmix!",
    "jalapeño\tpiña colada\nGruyère 😋 ｆｕｌｌｗｉｄｔｈ ﬁne",
    "<extra_id_0> hello <extra_id_99>",
    "",
]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_files_and_flan_t5_architecture(tiny_model_dir: Path, model, tokenizer) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_model_dir / name).is_file(), name
    cfg = model.config
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert cfg.feed_forward_proj == "gated-gelu" and cfg.is_gated_act
    assert cfg.relative_attention_num_buckets == 32
    assert (cfg.d_model, cfg.d_ff, cfg.d_kv, cfg.num_heads) == (64, 128, 16, 4)
    assert (cfg.num_layers, cfg.num_decoder_layers) == (2, 2)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id) == (0, 1, 0)
    assert cfg.vocab_size == len(tokenizer)
    # FLAN-T5 has an untied LM head, and config.json says so as flan-t5-xl's does.
    assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.shared.weight)
    assert json.loads((tiny_model_dir / "config.json").read_text())["tie_word_embeddings"] is False
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # tiny: the test suite trains it on CPU


def test_tokenizer_is_t5_style(tokenizer) -> None:
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token) == ("<pad>", "</s>", "<unk>")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("2 cups flour")["input_ids"]
    assert ids[-1] == 1 and ids.count(1) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "2 cups flour"
    # 100 sentinels, <extra_id_0> last as in T5, each a single token.
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == len(tokenizer) - 1
    assert tokenizer.convert_tokens_to_ids("<extra_id_99>") == len(tokenizer) - 100
    assert tokenizer("<extra_id_7>")["input_ids"] == [tokenizer.convert_tokens_to_ids("<extra_id_7>"), 1]
    assert 2000 <= len(tokenizer) <= 4200
    # A real vocabulary, not characters: common recipe words are single pieces.
    for word in ("▁flour", "▁sugar", "▁minutes", "▁oven"):
        assert word in tokenizer.get_vocab(), word


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_auto_tokenizer_matches_tokenizer_json(tiny_model_dir: Path, tokenizer, text: str) -> None:
    # The Rust loader tokenizes with tokenizer.json directly; what transformers loads must give the same ids.
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert tokenizer(text)["input_ids"] == raw.encode(text).ids


def test_forward_loss_is_finite_and_training_lowers_it(model, tokenizer) -> None:
    torch.manual_seed(0)
    model = type(model).from_pretrained(model.name_or_path)  # a private copy to train
    src = tokenizer(
        ["1 cup flour, 2 eggs, 1/2 cup milk", "1 lb. ground beef, 1 onion, chopped"],
        padding=True,
        return_tensors="pt",
    )
    labels = tokenizer(["Easy Pancakes", "Beef Skillet"], padding=True, return_tensors="pt").input_ids
    labels[labels == tokenizer.pad_token_id] = -100
    first = model(**src, labels=labels).loss
    assert math.isfinite(first.item())
    assert first.item() < 2 * math.log(len(tokenizer))  # sane init: near ln(vocab), not exploding
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(15):
        loss = model(**src, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first.item()


def test_generate_returns_decodable_text(model, tokenizer) -> None:
    enc = tokenizer(["Write a recipe with these ingredients: 2 cups flour, 1 egg"], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert out.shape[0] == 1 and 1 < out.shape[1] <= 13
    assert out[0, 0].item() == 0  # decoder_start_token_id
    assert isinstance(tokenizer.decode(out[0], skip_special_tokens=True), str)


def test_cli_builds_the_same_model_for_the_same_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "tiny-model", "--out", str(out), "--seed", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # log lines only: no progress bar (the tokenizer trainer's, blank lines in a log without a terminal)
    assert all(line.strip() for line in (proc.stdout + proc.stderr).splitlines()), proc.stdout + proc.stderr
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


@pytest.mark.parametrize("task", ["ingredients-to-recipe", "title-to-recipe"])
def test_prompts_and_targets_have_no_unknown_piece(tiny_model_dir: Path, task: str) -> None:
    # Every character of the presets' templates is in the vocabulary: before, the target's " | " was <unk>,
    # so a model could not learn where a section ends, nor could its output be read back.
    from trainer._loader import RecipeRenderer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    r = RecipeRenderer(task=task)
    rendered = r.render(
        title="Lemon Pie", ingredients=["2 eggs", "1 cup flour"], directions=["Mix.", "Bake."]
    )
    literal = (r.source_template + r.target_template).replace("{", "").replace("}", "")
    for text in (rendered["source"], rendered["reference"], literal):
        ids = raw.encode(text).ids
        assert raw.token_to_id("<unk>") not in ids, raw.encode(text).tokens
    assert raw.decode(raw.encode(rendered["reference"]).ids) == rendered["reference"]
