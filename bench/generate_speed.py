"""Generation speed of `trainer generate` against Hugging Face's `generate` at its best, in one run, with the
memory-bandwidth bound beside each.

Every path generates for the same held-out prompts with the same weights (FLAN-T5-XL's shape, random init, no
Hub), bf16 on the GPU, greedy:

- Hugging Face eager: `model.generate` over fixed batches of 8, 32, 64 and 128 prompts in input order, padded
  to the longest, the model as `from_pretrained` gives it (Hugging Face's default attention, dynamic cache).
  The best batch size is the peer. Small batches time a sample of the prompts (at least 2 batches): a
  batch's rate does not depend on which prompts it holds.
- Hugging Face static cache + torch.compile (`cache_implementation="static"`, which transformers compiles
  on its own), at the best eager batch size; when it does not run for T5 on this stack, the error is said.
- trainer generate: `trainer.eval.generate.generate_ids` on the model as `trainer generate` loads it (the
  decoding engine: static caches, CUDA graphs, continuous batching) at a 32k-token budget (about Hugging
  Face's batch 64 in memory), at twice that (its batch 128) and at the budget `trainer generate` takes on
  this GPU by default (half its free memory, at most 131,072), greedy; and once sampling with every processor.

A random-init model does not stop early, so every path writes exactly `--new-tokens` per prompt
(`min_new_tokens = max_new_tokens`). The bound: a decoder step must read the decoder's weights and head once,
and each busy row's cross-attention keys and values (its prompt) and self-attention cache (its tokens so far);
bytes over the copy bandwidth measured here (device-to-device, read + write) is the floor of the decode, and
the encoder's FLOPs over the matmul rate measured here that of the encoding. "share of bound" is that floor
over the measured time. Exactness: the share of prompts whose greedy tokens equal Hugging Face's, and where
the first difference falls.

    python3 bench/generate_speed.py                   # GPU: XL shape, 256 prompts x 256 new tokens
    python3 bench/generate_speed.py --tiny            # CPU check of the script: tiny shape, small sizes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainer.data.prompt import PromptTemplate
from trainer.data.sample import write_sample
from trainer.eval.generate import (
    DEFAULT_BATCH_TOKENS,
    batch_token_budget,
    generate_ids,
    prepare_for_generation,
)
from trainer.model.tiny_model import flan_t5_config, recipe_texts, train_tokenizer

HF_BATCHES = (8, 32, 64, 128)


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


def hf_loop(model, prompts: list[list[int]], batch_size: int, **kwargs) -> list[list[int]]:
    """What a user writes: fixed-size batches in input order, padded to the longest; each row's new ids."""
    out = []
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
            seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        out += seqs[:, 1:].tolist()
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """(result, seconds, peak GiB allocated)."""
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = fn()
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return result, time.perf_counter() - start, peak


def device_ceilings() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), measured here."""
    if not torch.cuda.is_available():
        return float("nan"), float("nan")
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        dst.copy_(src)
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    sync()
    bandwidth = 2 * src.numel() * 20 / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    flops = 2 * 8192**3 * 10 / (time.perf_counter() - start)
    del src, dst, a, b
    torch.cuda.empty_cache()
    return bandwidth, flops


def floor_s(config, prompts, new_tokens: int, steps: int, bandwidth: float, flops: float) -> float:
    """The fewest seconds generating for `prompts` can take in `steps` decoder steps: bytes each step must
    read (decoder weights and head once per step; each row's caches) over the bandwidth, plus the encoder's
    FLOPs over the matmul rate."""
    d, inner, layers = config.d_model, config.num_heads * config.d_kv, config.num_decoder_layers
    ff = config.d_ff * (3 if config.is_gated_act else 2)
    decoder_weights = layers * (4 * d * inner + 2 * d * inner + d * ff) + config.vocab_size * d
    per_token_kv = layers * 2 * inner * 2  # keys and values, bf16, one position of one layer's cache
    kv = 0
    for p in prompts:
        kv += new_tokens * len(p) * per_token_kv  # the cross-attention's, every step
        kv += per_token_kv * new_tokens * (new_tokens + 1) // 2  # the self-attention's, growing
    encoder_flops = 2 * sum(map(len, prompts)) * config.num_layers * (4 * d * inner + d * ff)
    return (steps * decoder_weights * 2 + kv) / bandwidth + encoder_flops / flops


def first_differences(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, list[int]]:
    """(share of rows identical, the first differing position of each other row)."""
    same, firsts = 0, []
    for a, b in zip(ours, theirs, strict=True):
        if a == b:
            same += 1
        else:
            firsts.append(next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y))
    return same / len(ours), firsts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (a check, not a measurement)")
    ap.add_argument("--prompts", type=int, help="held-out prompts (default 256; 32 with --tiny)")
    ap.add_argument("--new-tokens", type=int, help="tokens written per prompt (default 256; 16 with --tiny)")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=list(HF_BATCHES), help="Hugging Face sizes")
    ap.add_argument("--no-static", action="store_true", help="skip Hugging Face's static cache + compile")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    n = args.prompts or (32 if args.tiny else 256)
    new_tokens = args.new_tokens or (16 if args.tiny else 256)
    budget = DEFAULT_BATCH_TOKENS if not args.tiny else 2048
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
    use_fused_t5_ops(ours)  # as trainer.model.load.load_model loads models for `trainer generate` (SDPA)
    ours = prepare_for_generation(ours)
    forced = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    bandwidth, flops = device_ceilings()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    shape = "tiny" if args.tiny else "FLAN-T5-XL"
    print(
        f"{shape} shape, random init, {str(dtype).removeprefix('torch.')} on {gpu}; {n} prompts (source "
        f"tokens p50 {int(statistics.median(lengths))}, max {lengths[-1]}), {new_tokens} new tokens each "
        f"(forced), greedy; measured here: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul "
        f"{flops / 1e12:.0f} TFLOP/s",
        flush=True,
    )

    rows: list[dict] = []

    def record(name, prompts_run, seconds, peak, steps, extra=""):
        tokens = len(prompts_run) * new_tokens
        bound = floor_s(config, prompts_run, new_tokens, steps, bandwidth, flops)
        rows.append(
            dict(
                path=name,
                prompts=len(prompts_run),
                seconds=seconds,
                tokens_per_s=tokens / seconds,
                prompts_per_s=len(prompts_run) / seconds,
                peak_gib=peak,
                share_of_bound=bound / seconds,
                note=extra,
            )
        )
        r = rows[-1]
        print(
            f"  {name}: {r['tokens_per_s']:,.0f} new tokens/s, {r['prompts_per_s']:.2f} prompts/s, "
            f"peak {peak:.1f} GiB, {100 * r['share_of_bound']:.1f}% of the bound {extra}",
            flush=True,
        )

    # Hugging Face eager: warm-up, then each batch size on at least two batches of prompts.
    hf_loop(plain, prompts[:8], 8, **{**forced, "max_new_tokens": 2, "min_new_tokens": 2})
    hf_outputs: dict[int, list[list[int]]] = {}
    for batch in args.hf_batches:
        sample = prompts[: min(n, max(2 * batch, 32))]
        try:
            out, s, peak = timed(lambda sample=sample, batch=batch: hf_loop(plain, sample, batch, **forced))
        except torch.OutOfMemoryError:
            print(f"  Hugging Face eager, batch {batch}: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        hf_outputs[batch] = out
        steps = -(-len(sample) // batch) * new_tokens
        record(f"HF generate, eager, batch {batch}", sample, s, peak, steps)
    best = max((r for r in rows), key=lambda r: r["tokens_per_s"])
    best_batch = int(best["path"].rsplit(" ", 1)[1])

    # trainer generate: warm-up (Triton's compilation), then the default budget and twice it.
    generate_ids(
        ours, prompts[:8], max_batch_tokens=budget, **{**forced, "max_new_tokens": 2, "min_new_tokens": 2}
    )
    from trainer.eval.decoding import Decoding, decode

    ours_out = None
    decoding = Decoding(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    auto = batch_token_budget(ours, None)
    budgets = ((f"{budget // 1024}k", budget), (f"{2 * budget // 1024}k", 2 * budget), ("auto", auto))
    for name, tokens in budgets:
        with torch.no_grad():
            (out, engine), s, peak = timed(
                lambda t=tokens: decode(ours, prompts, decoding, max_batch_tokens=t)
            )
        ours_out = ours_out or out
        assert [len(x) for x in out] == [new_tokens] * n, "trainer generate wrote another number of tokens"
        record(
            f"trainer generate, {name}-token budget", prompts, s, peak, engine.steps,
            f"({tokens} tokens: {engine.slots} rows at a time, {engine.captures} graphs)",
        )  # fmt: skip
        del engine  # its caches, before the next run measures its peak
    sampled = Decoding(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=0.8, top_k=50,
        top_p=0.9, repetition_penalty=1.2, no_repeat_ngram_size=3,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        (out, engine), s, peak = timed(lambda: decode(ours, prompts, sampled, max_batch_tokens=budget))
    record(
        f"trainer generate, {budget // 1024}k, sampling + every processor", prompts, s, peak, engine.steps,
        "(temperature 0.8, top_k 50, top_p 0.9, repetition_penalty 1.2, no_repeat_ngram_size 3)",
    )  # fmt: skip
    del engine

    if not args.no_static:
        sample = prompts[: min(n, 2 * best_batch)]
        static = {**forced, "cache_implementation": "static"}
        try:
            hf_loop(plain, sample[:best_batch], best_batch, **static)  # compiles
            out, s, peak = timed(lambda: hf_loop(plain, sample, best_batch, **static))
            steps = -(-len(sample) // best_batch) * new_tokens
            record(f"HF generate, static cache + compile, batch {best_batch}", sample, s, peak, steps)
        except Exception as e:  # what fails is the finding
            line = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            print(f"  HF generate, static cache + compile: does not run here ({line})", flush=True)
            rows.append(dict(path="HF generate, static cache + compile", error=line))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    peer = best
    print()
    print(f"{'path':<62} {'tokens/s':>9} {'prompts/s':>9} {'peak GiB':>8} {'% bound':>8} {'vs peer':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['path']:<62} {'does not run: ' + r['error']}")
            continue
        print(
            f"{r['path']:<62} {r['tokens_per_s']:>9,.0f} {r['prompts_per_s']:>9.2f} {r['peak_gib']:>8.1f} "
            f"{100 * r['share_of_bound']:>7.1f}% {r['tokens_per_s'] / peer['tokens_per_s']:>7.2f}x"
        )
    print(f"peer: {peer['path']} (the best Hugging Face eager batch size)")
    for batch, theirs in sorted(hf_outputs.items()):
        same, firsts = first_differences(ours_out[: len(theirs)], theirs)
        where = f", first difference at token p50 {int(statistics.median(firsts))}" if firsts else ""
        print(f"greedy tokens identical to HF eager batch {batch}: {100 * same:.0f}% of {len(theirs)}{where}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
