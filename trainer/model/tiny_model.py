"""A tiny random FLAN-T5 and a T5-style tokenizer, built offline, standing in for `google/flan-t5-xl`.

No machine here can reach the Hugging Face Hub, so tests and the quickstart use this: the FLAN-T5 architecture
(gated-GELU feed-forward, untied LM head, relative attention) at toy size with random weights, and a
SentencePiece-Unigram tokenizer trained with the `tokenizers` library on generated recipes, laid out like
flan-t5's tokenizer.json (pad=0, eos=1, unk=2, `</s>` appended by the post-processor, 100 `<extra_id_N>`
sentinels).
"""

from __future__ import annotations

import bisect
import json
import logging
import tempfile
from pathlib import Path

from trainer._loader import RecipeRenderer, write_sample
from trainer.config import TASKS
from trainer.model.model_files import write_config
from trainer.model.model_shape import KNOWN_CONFIGS

log = logging.getLogger(__name__)

N_RECIPES = 3000
VOCAB_SIZE = 3000  # the trainer stops near 2,000 on this corpus; sentinels come on top
EXTRA_IDS = 100
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2 as in T5


def recipe_texts(path: Path, tasks: tuple[str, ...] = TASKS, limit: int | None = None) -> list[str]:
    """What the loader renders from these recipes (the first `limit`), through its own renderer: each of
    `tasks`' prompt and the target (`title: ... | ingredients: ... | directions: 1. ...`)."""
    texts = []
    for task in tasks:
        records, _, _ = RecipeRenderer(task=task).read([str(path)])
        records = records[:limit]
        texts += [r["source"] for r in records]
    texts += [r["reference"] for r in records]
    return texts


def _template_alphabet() -> list[str]:
    """Every character of the presets' templates: the tokenizer must cover each (no `<unk>` in a prompt or in
    the ` | ` between a target's sections), however rare it is in the corpus."""
    chars = set()
    for task in TASKS:
        r = RecipeRenderer(task=task)
        chars |= set(r.source_template) | set(r.target_template)
    return sorted(chars - set("{} "))


def _canonical_vocab(vocab: list[list]) -> list[list]:
    """Make the trained Unigram vocab independent of hash-map order, so one seed gives one tokenizer.json.

    The trainer's scores vary in the last bits from run to run, and it appends the characters it must cover in
    arbitrary order with scores stepping down by 1e-4. Round the scores, order pieces by score then text, and
    give that trailing run of characters its scores in character order.
    """
    n_special = len(SPECIAL_TOKENS)
    pieces = [(p, round(s, 6)) for p, s in vocab[n_special:]]
    # The appended characters: single characters whose score is 1e-4 from another single character's.
    char_scores = sorted(s for p, s in pieces if len(p) == 1)

    def near(x: float) -> bool:
        i = bisect.bisect_left(char_scores, x - 1e-7)
        return i < len(char_scores) and char_scores[i] <= x + 1e-7

    in_run = [len(p) == 1 and (near(s - 1e-4) or near(s + 1e-4)) for p, s in pieces]
    run_chars = sorted(p for (p, _), r in zip(pieces, in_run, strict=True) if r)
    run_scores = sorted((s for (_, s), r in zip(pieces, in_run, strict=True) if r), reverse=True)
    pieces = [x for x, r in zip(pieces, in_run, strict=True) if not r] + list(
        zip(run_chars, run_scores, strict=True)
    )
    pieces.sort(key=lambda x: (-x[1], x[0]))
    return vocab[:n_special] + [list(x) for x in pieces]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Train a T5-style Unigram `tokenizers.Tokenizer` on `texts`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from tokenizers.trainers import UnigramTrainer

    tok = Tokenizer(Unigram())
    # flan-t5 uses SentencePiece's precompiled nmt_nfkc charsmap; NFKC is the closest built-in equivalent.
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        unk_token="<unk>",
        max_piece_length=16,
        n_sub_iterations=2,
        shrinking_factor=0.75,
        initial_alphabet=_template_alphabet(),
        show_progress=False,  # its bars are blank lines in a log without a terminal
    )
    tok.train_from_iterator(texts, trainer)
    data = json.loads(tok.to_str())
    data["model"]["vocab"] = _canonical_vocab(data["model"]["vocab"])
    tok = Tokenizer.from_str(json.dumps(data))
    eos_id = tok.token_to_id("</s>")
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != [0, 1, 2]:
        raise RuntimeError("tokenizer trainer did not put <pad>, </s>, <unk> at ids 0, 1, 2")
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", eos_id)]
    )
    # T5 puts the sentinels last, <extra_id_0> with the highest id.
    tok.add_special_tokens([AddedToken(f"<extra_id_{i}>", special=True) for i in reversed(range(EXTRA_IDS))])
    return tok


# The tiny stand-in's size; every other FLAN-T5 hyperparameter is the real model's.
TINY_SHAPE = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4)


def flan_t5_config(shape: str = "xl", vocab_size: int = 32128):
    """A FLAN-T5 architecture (gated-GELU, untied head, relative attention, T5's special ids) without weights:
    `shape` "xl" is google/flan-t5-xl's (trainer.model.model_shape.KNOWN_CONFIGS), "tiny" this module's
    stand-in."""
    from transformers import T5Config

    sizes = TINY_SHAPE if shape == "tiny" else KNOWN_CONFIGS[f"google/flan-t5-{shape}"]
    flan = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "dropout_rate": 0.1}
    ids = {"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
    return T5Config(**{**flan, **sizes, "vocab_size": vocab_size, **ids})


def save_tokenizer(tok, out: Path) -> int:
    """Save a trained `tokenizers.Tokenizer` with T5's special tokens to `out` (tokenizer.json and
    tokenizer_config.json, via save_pretrained); returns the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=[f"<extra_id_{i}>" for i in range(EXTRA_IDS)],
        model_max_length=512,
    )
    hf_tok.save_pretrained(out)
    # transformers 5 rebuilds a "T5Tokenizer" from its vocab and keeps only a SentencePiece Precompiled
    # normalizer, dropping our NFKC one, so its ids would differ from tokenizer.json on text like "½".
    # The generic class loads tokenizer.json as is, in transformers 4 and 5 alike.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return len(hf_tok)


def build_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """Write a tiny random T5ForConditionalGeneration and its tokenizer to `out` (created); return `out`."""
    import torch
    from transformers import GenerationConfig, T5ForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tiny-model-") as tmp:
        corpus = Path(tmp) / "recipes.jsonl"
        write_sample(str(corpus), N_RECIPES, seed, "jsonl")  # the Rust generator (trainer.data.sample)
        tok = train_tokenizer(recipe_texts(corpus))

    vocab_size = save_tokenizer(tok, out)
    config = flan_t5_config("tiny", vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T5ForConditionalGeneration(config)
        # transformers 5 forces T5Config.tie_word_embeddings to True and ties lm_head to the embedding at
        # init; FLAN-T5 has its own head. A separate head, scaled so initial logits are ~N(0, 1) (the loss
        # starts near ln(vocab) and the quickstart learns within a minute), is saved as its own tensor, and
        # from_pretrained keeps it untied because it differs from the embedding, as for google/flan-t5-xl.
        model.lm_head.weight = torch.nn.Parameter(
            torch.randn(config.vocab_size, config.d_model) * config.d_model**-0.5
        )
    # A model this small loops under greedy decoding ("2 cups 2 cups ..."); its generation config says not to
    # repeat a trigram, as a model card would. No max_new_tokens: `trainer generate` then writes up to the
    # training run's max_target_length, a whole recipe. The real FLAN-T5 brings its own generation config.
    model.generation_config = GenerationConfig(
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, no_repeat_ngram_size=3
    )
    model.save_pretrained(out, safe_serialization=True)
    # config.json as flan-t5-xl's reads ("tie_word_embeddings": false), so that loading this model goes down
    # the same code path as loading the real one, and as every checkpoint of it is written.
    write_config(model, out)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("wrote a tiny FLAN-T5 (%d parameters, vocab %d) to %s", n_params, vocab_size, out)
    return out
