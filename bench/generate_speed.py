"""Generation speed of `trainer generate`'s path against a plain Hugging Face loop, in one run.

Both sides generate for the same held-out prompts with the same weights (FLAN-T5-XL's shape, random init, no
Hub), in bf16 on the GPU, greedy, with the KV cache:

- plain HF: `model.generate` over batches of 8 prompts in input order, each padded to its longest prompt, the
  model as `from_pretrained` gives it (Hugging Face's default attention);
- trainer generate: `trainer.eval.generate.generate_ids` (prompts sorted by length, batches under a token
  budget, longest first) on the model as `trainer generate` loads it (T5's norms and GELU fused,
  `prepare_for_generation`: eval, cache).

The prompts are generated recipes rendered by the training loader's renderer and tokenized with a T5-layout
tokenizer trained offline (`trainer.model.tiny_model`; its 2k vocabulary splits recipes into somewhat more
tokens than FLAN-T5's 32k). A random-init model does not stop early, so both sides are forced to write exactly
`--new-tokens` tokens per prompt (`min_new_tokens = max_new_tokens`): tokens/s compare like with like.

    python3 bench/generate_speed.py            # GPU: XL shape, 256 prompts x 128 new tokens
    python3 bench/generate_speed.py --tiny     # CPU check: the tiny shape, 32 prompts x 16 new tokens
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainer.data.prompt import PromptTemplate
from trainer.data.sample import write_sample
from trainer.eval.generate import DEFAULT_BATCH_TOKENS, generate_ids, prepare_for_generation
from trainer.model.tiny_model import flan_t5_config, recipe_texts, train_tokenizer


def prompts_and_tokenizer(n: int, workdir: Path) -> tuple[list[list[int]], int]:
    """Ids of `n` held-out prompts (recipes the tokenizer was not trained on), and the vocabulary size."""
    corpus, held_out = workdir / "corpus.jsonl", workdir / "held_out.jsonl"
    write_sample(corpus, 3000, seed=0, fmt="jsonl")
    write_sample(held_out, n, seed=1234, fmt="jsonl")
    tok = train_tokenizer(recipe_texts(corpus))
    tok.save(str(workdir / "tokenizer.json"))
    template = PromptTemplate.preset("ingredients-to-recipe", max_source_length=512)
    records, _, _ = template.renderer(workdir / "tokenizer.json").read([str(held_out)])
    return [r["source_ids"] for r in records[:n]], tok.get_vocab_size()


def hf_loop(model, prompts: list[list[int]], batch_size: int, **kwargs) -> list[int]:
    """What a user writes: fixed-size batches in input order, padded to the longest; new tokens per prompt."""
    counts = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, : len(p)] = torch.as_tensor(p)
            mask[row, : len(p)] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        counts += [out.shape[1] - 1] * len(batch)
    return counts


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (a check, not a measurement)")
    ap.add_argument("--prompts", type=int, help="held-out prompts (default 256; 32 with --tiny)")
    ap.add_argument("--new-tokens", type=int, help="tokens written per prompt (default 128; 16 with --tiny)")
    ap.add_argument("--batch-size", type=int, default=8, help="the plain loop's batch size (default 8)")
    ap.add_argument(
        "--max-batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS, help="trainer generate's budget"
    )
    args = ap.parse_args()
    n = args.prompts or (32 if args.tiny else 256)
    new_tokens = args.new_tokens or (16 if args.tiny else 128)
    budget = args.max_batch_tokens if not args.tiny else 2048
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16

    with tempfile.TemporaryDirectory(prefix="generate-speed-") as tmp:
        prompts, vocab = prompts_and_tokenizer(n, Path(tmp))
    lengths = sorted(map(len, prompts))
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.model_files import dtype_kwarg
    from trainer.model.swaps import use_fused_t5_ops

    config = flan_t5_config("tiny" if args.tiny else "xl", vocab_size=32128 if not args.tiny else vocab)
    torch.manual_seed(0)
    with torch.device(device):
        plain = AutoModelForSeq2SeqLM.from_config(config, **{dtype_kwarg(): dtype}).eval()
        ours = AutoModelForSeq2SeqLM.from_config(config, **{dtype_kwarg(): dtype})
    ours.load_state_dict(plain.state_dict())
    use_fused_t5_ops(ours)  # as trainer.model.load.load_model loads models for `trainer generate`
    ours = prepare_for_generation(ours)
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    shape = "tiny" if args.tiny else "FLAN-T5-XL"
    print(
        f"{shape} shape, random init, {str(dtype).removeprefix('torch.')} on {gpu}; "
        f"{n} prompts (source tokens p50 {int(statistics.median(lengths))}, max {lengths[-1]}), "
        f"{new_tokens} new tokens each (forced), greedy, KV cache"
    )

    # Warm-up: cuBLAS handles, the fused kernels' compilation, the allocator.
    hf_loop(
        plain,
        prompts[: args.batch_size],
        args.batch_size,
        **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2},
    )
    generate_ids(
        ours, prompts[:8], max_batch_tokens=budget, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
    )

    plain_counts, plain_s = timed(lambda: hf_loop(plain, prompts, args.batch_size, **kwargs))
    ours_ids, ours_s = timed(lambda: generate_ids(ours, prompts, max_batch_tokens=budget, **kwargs))
    ours_counts = [len(x) for x in ours_ids]
    assert ours_counts == [new_tokens] * n, "trainer generate's path wrote another number of tokens"
    assert plain_counts == [new_tokens] * n, "the plain loop wrote another number of tokens"

    rows = [
        (f"plain HF loop, batch {args.batch_size}, input order", plain_s, sum(plain_counts)),
        (f"trainer generate, {budget}-token budget, by length", ours_s, sum(ours_counts)),
    ]
    print(f"{'path':<48} {'seconds':>8} {'prompts/s':>10} {'new tokens/s':>13}")
    for name, s, tokens in rows:
        print(f"{name:<48} {s:8.1f} {n / s:10.2f} {tokens / s:13.0f}")
    print(f"ratio (trainer generate / plain loop): {plain_s / ours_s:.2f}x tokens/s")
    if device.type == "cuda":
        print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
