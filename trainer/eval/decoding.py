"""The decoding engine: greedy and sampled generation for `trainer generate`, `trainer evaluate`, the
evaluation during training and `trainer serve`, at the speed of the GPU's memory rather than of Python.

A decoder step at batch 64 must read the decoder's weights and every row's caches once: a few GB, about
2 ms on an H100. Hugging Face's `generate` launches each of the step's ~400 kernels from Python, grows its
cache and makes masks every step, and waits for the GPU at every token; on FLAN-T5-XL that is about
15x the bound. The engine:

- keeps a fixed number of *slots* (rows), each with its own position, in static caches: the
  self-attention's keys and values (layers, slots, heads, max_new_tokens + 1, head size) and the
  cross-attention's (layers, slots, heads, longest prompt, head size). A prompt joins a free slot: the
  encoder runs once for all the prompts joining together, and their cross-attention keys and values are
  computed once (`start`).
- runs a step for the first `bucket` slots (the smallest power of two holding every busy slot): embedding,
  24 blocks through trainer.model.t5_decoding (the attention reads each row's valid prefix only), the head,
  the logits processors, the choice of the next token, and the update of every row's state, all on the
  GPU. On CUDA the first step of a bucket runs eagerly and is captured as a CUDA graph; every later step
  is one replay (`step`).
- lets a finished row leave and a waiting prompt take its slot between steps (continuous batching), so a
  row that stops early frees its slot at once instead of idling until the longest row of its batch ends.

The choice follows Hugging Face's logits processors, in their order, on fp32 logits: repetition_penalty,
no_repeat_ngram_size, min_new_tokens (min_length), then with do_sample temperature, top_k, top_p and a draw
(Gumbel-max: argmax of the scores plus Gumbel noise draws from softmax(scores), with no host
synchronisation). Every option is a per-row tensor, so requests with different options share one step;
the graph of a step includes only the processors some busy row uses. `Decoding.of` resolves
`model.generate`'s keyword arguments against the model's generation_config and says which settings only
Hugging Face's `generate` has (beam search, constraints, ...): `generate_ids` hands those to it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from trainer.model.t5_decoding import T5DecodingParts, supports_static_decoding

log = logging.getLogger(__name__)

# Hugging Face's values for what a generation_config leaves unset (transformers 5 keeps None and fills these
# in at generate time).
HF_DEFAULTS = {
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "num_beams": 1,
}
# generation_config settings that only Hugging Face's generate implements, with the value that means "off".
HF_ONLY = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "penalty_alpha": None,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "top_h": None,
    "guidance_scale": 1.0,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "exponential_decay_length_penalty": None,
    "watermarking_config": None,
    "prompt_lookup_num_tokens": None,
    "dola_layers": None,
    "max_time": None,
    "stop_strings": None,
    "assistant_model": None,
}
# generate() keyword arguments that change nothing the engine returns
NEUTRAL_KWARGS = {"use_cache", "return_dict_in_generate", "output_scores", "output_logits", "length_penalty"}
STEPS_PER_CHECK = 8  # steps between two looks at which rows finished (each look waits for the GPU)
PREFILL_TOKENS = 16384  # prompt tokens the encoder runs at once when many prompts join (its activations)


@dataclass(frozen=True)
class Decoding:
    """One row's decoding options, resolved (Hugging Face's meaning)."""

    max_new_tokens: int
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0

    @staticmethod
    def of(model, kwargs: dict[str, Any]) -> Decoding | str:
        """`model.generate(**kwargs)`'s decoding with `model.generation_config` beneath, or, when it needs
        what only Hugging Face's generate has, the reason in a few words."""
        if kwargs.get("synced_gpus"):
            return "synced_gpus (sharded weights: every rank steps together)"
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k != "synced_gpus"}
        settings = {k: v for k, v in model.generation_config.to_dict().items() if v is not None}
        settings.update(kwargs)
        for name, off in HF_ONLY.items():
            value = settings.get(name)
            if value is not None and value != off and value != []:
                return f"{name}={value}"
        extra = set(kwargs) - set(HF_DEFAULTS) - set(HF_ONLY) - NEUTRAL_KWARGS
        extra -= {"max_new_tokens", "min_new_tokens"}
        if extra:
            return f"{', '.join(sorted(extra))} given"
        value = {**HF_DEFAULTS, **settings}
        max_new = value.get("max_new_tokens") or max(1, value["max_length"] - 1)
        min_new = max(value.get("min_new_tokens") or 0, value["min_length"] - 1, 0)
        sample = bool(value["do_sample"])
        return Decoding(
            max_new_tokens=int(max_new),
            min_new_tokens=int(min_new),
            do_sample=sample,
            temperature=float(value["temperature"]) if sample else 1.0,
            top_k=int(value["top_k"] or 0) if sample else 0,
            top_p=float(value["top_p"]) if sample else 1.0,
            repetition_penalty=float(value["repetition_penalty"]),
            no_repeat_ngram_size=int(value["no_repeat_ngram_size"]),
        )


class Features(NamedTuple):
    """Which processors a step runs (a graph per bucket and set of features)."""

    sample: bool
    truncate: bool  # top_k or top_p
    penalty: bool
    ngram: int  # the largest no_repeat_ngram_size; 0: off
    min_new: bool

    @staticmethod
    def of(rows: Sequence[Decoding]) -> Features:
        return Features(
            sample=any(r.do_sample for r in rows),
            truncate=any(r.do_sample and (r.top_k > 0 or r.top_p < 1.0) for r in rows),
            penalty=any(r.repetition_penalty != 1.0 for r in rows),
            ngram=_ngram_bucket(max((r.no_repeat_ngram_size for r in rows), default=0)),
            min_new=any(r.min_new_tokens > 0 for r in rows),
        )


def _ngram_bucket(n: int) -> int:
    """The n-gram size a step's ban runs at: the next power of two (a row's own size masks the rest), so that
    requests with sizes 3 and 4 share a CUDA graph, and a graph is made for at most 6 sizes (2 to 32)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def static_decoding_reason(model, kwargs: dict[str, Any]) -> Decoding | str:
    """The engine's Decoding for `model.generate(**kwargs)`, or why Hugging Face's generate must run it."""
    reason = supports_static_decoding(model)
    if reason is not None:
        return reason
    return Decoding.of(model, kwargs)


class DecodingEngine:
    """Slots of static caches and the step that advances every busy slot by one token (see the module doc).

    `start` puts prompts into free slots, `step` advances, `finished` says which slots are done and `take`
    returns a done slot's tokens and frees it. `tokens_now` gives each busy slot's newest token (streaming).
    Not thread-safe: one thread drives it."""

    def __init__(
        self,
        model,
        *,
        slots: int,
        max_source_tokens: int,
        max_new_tokens: int,
        graphs: bool | None = None,
    ):
        self.parts = T5DecodingParts(model)
        parts = self.parts
        config = model.generation_config
        device = self.device = parts.device
        self.slots, self.source_capacity = slots, max(1, max_source_tokens)
        self.length = max_new_tokens + 1  # decoder positions: the start token and the new ones
        self.pad = config.pad_token_id if config.pad_token_id is not None else 0
        self.start_token = config.decoder_start_token_id
        if self.start_token is None:
            self.start_token = self.pad
        eos = config.eos_token_id
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        self.eos = torch.tensor(eos or [-1], device=device)
        self.vocab = parts.vocab_size
        self.eos_mask = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        self.eos_mask[[e for e in eos if 0 <= e < self.vocab]] = True
        cache = (parts.layers, slots, parts.heads, self.length, parts.head_dim)
        cross = (parts.layers, slots, parts.heads, self.source_capacity, parts.head_dim)
        with torch.no_grad():
            self.self_keys = torch.zeros(cache, dtype=parts.dtype, device=device)
            self.self_values = torch.zeros(cache, dtype=parts.dtype, device=device)
            self.cross_keys = torch.zeros(cross, dtype=parts.dtype, device=device)
            self.cross_values = torch.zeros(cross, dtype=parts.dtype, device=device)
            self.bias = parts.distance_bias(self.length)
        self.cache_bytes = sum(
            t.numel() * t.element_size()
            for t in (self.self_keys, self.self_values, self.cross_keys, self.cross_values)
        )

        def state(value, dtype):
            return torch.full((slots,), value, dtype=dtype, device=device)

        # Each slot's decoding state: the token it feeds next and its position, whether it is done, its
        # source length, and its tokens so far (position 0: the start token).
        self.tokens = state(self.pad, torch.long)
        self.positions = state(0, torch.long)
        self.done = state(True, torch.bool)
        self.source_lengths = state(1, torch.int32)
        self.history = torch.full((slots, self.length), self.pad, dtype=torch.long, device=device)
        self.presence: torch.Tensor | None = None  # (slots, vocab) tokens seen: made when a row penalises
        # Each slot's options, as tensors (a step mixes rows with different options).
        self.max_new = state(1, torch.long)
        self.min_new = state(0, torch.long)
        self.sample = state(False, torch.bool)
        self.temperature = state(1.0, torch.float32)
        self.top_k = state(self.vocab, torch.long)
        self.top_p = state(1.0, torch.float32)
        self.penalty = state(1.0, torch.float32)
        self.ngram = state(0, torch.long)
        self.rows: list[Decoding | None] = [None] * slots  # host side: who holds each slot
        self.use_graphs = device.type == "cuda" if graphs is None else graphs
        self.graphs: dict[tuple[int, Features], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps = 0  # steps run (each reads the weights once)
        self.captures = 0

    # -- slots ------------------------------------------------------------------------------------------

    def free_slots(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row is None]

    def busy(self) -> int:
        return sum(row is not None for row in self.rows)

    def start(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], decodings: Sequence[Decoding]):
        """Put `prompts` (token ids) into free `slots`, each with its decoding: runs the encoder for them
        together and stores their cross-attention keys and values."""
        if not prompts:
            return
        for slot, prompt, decoding in zip(slots, prompts, decodings, strict=True):
            if self.rows[slot] is not None:
                raise ValueError(f"slot {slot} is busy")
            if len(prompt) > self.source_capacity:
                raise ValueError(f"a prompt of {len(prompt)} tokens is over {self.source_capacity}")
            if decoding.max_new_tokens > self.length - 1:
                raise ValueError(f"max_new_tokens {decoding.max_new_tokens} is over {self.length - 1}")
        device = self.device
        slots = list(slots)
        width = max(1, max(len(p) for p in prompts))
        per_chunk = max(1, PREFILL_TOKENS // width)
        for start in range(0, len(prompts), per_chunk):
            self._encode(slots[start : start + per_chunk], prompts[start : start + per_chunk])
        index = torch.as_tensor(slots, device=device)
        with torch.no_grad():
            self.tokens[index] = self.start_token
            self.positions[index] = 0
            self.done[index] = False
            self.history[index] = self.pad
            self.history[index, 0] = self.start_token

            def put(tensor, name, off_value=None):
                values = [getattr(d, name) for d in decodings]
                if off_value is not None:
                    values = [off_value if v == 0 else v for v in values]
                tensor[index] = torch.as_tensor(values, dtype=tensor.dtype).to(device)

            put(self.max_new, "max_new_tokens")
            put(self.min_new, "min_new_tokens")
            put(self.sample, "do_sample")
            put(self.temperature, "temperature")
            put(self.top_k, "top_k", off_value=self.vocab)
            put(self.top_p, "top_p")
            put(self.penalty, "repetition_penalty")
            put(self.ngram, "no_repeat_ngram_size")
            if any(d.repetition_penalty != 1.0 for d in decodings):
                if self.presence is None:
                    self.presence = torch.zeros((self.slots, self.vocab), dtype=torch.bool, device=device)
                self.presence[index] = False
                self.presence[index, self.start_token] = True
        for slot, decoding in zip(slots, decodings, strict=True):
            self.rows[slot] = decoding

    def _encode(self, slots: list[int], prompts: Sequence[Sequence[int]]) -> None:
        """The encoder over `prompts` (right-padded together), their cross-attention keys and values and
        lengths into `slots`."""
        device = self.device
        width = max(1, max(len(p) for p in prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, : len(prompt)] = 1
        mask[:, 0] = 1  # an empty prompt attends to one padding token rather than to nothing
        index = torch.as_tensor(slots, device=device)
        with torch.no_grad():
            hidden = self.parts.encode(ids.to(device), mask.to(device))
            for layer, (k, v) in enumerate(self.parts.cross_keys_values(hidden)):
                self.cross_keys[layer][index, :, :width] = k
                self.cross_values[layer][index, :, :width] = v
            self.source_lengths[index] = mask.sum(1).to(device=device, dtype=torch.int32)

    def finished(self) -> list[int]:
        """The busy slots that are done (waits for the GPU)."""
        done = self.done.tolist()
        return [i for i, row in enumerate(self.rows) if row is not None and done[i]]

    def take(self, slot: int) -> list[int]:
        """A done slot's new tokens (through its end-of-sequence token); the slot is free again."""
        count = int(self.positions[slot])
        ids = self.history[slot, 1 : count + 1].tolist()
        self.rows[slot] = None
        return ids

    def release(self, slot: int) -> None:
        """Free a slot whether or not it is done (a request that was cancelled)."""
        self.rows[slot] = None
        self.done[slot] = True

    def tokens_now(self) -> tuple[list[int], list[bool], list[int]]:
        """Per slot: the newest token, whether the slot is done, and how many tokens it has (one wait for the
        GPU)."""
        state = torch.stack([self.tokens, self.done.long(), self.positions]).tolist()
        return state[0], [bool(d) for d in state[1]], state[2]

    # -- the step ---------------------------------------------------------------------------------------

    def step(self, count: int = 1) -> None:
        """Advance every busy slot by `count` tokens (done slots stay as they are)."""
        busy = [i for i, row in enumerate(self.rows) if row is not None]
        if not busy:
            return
        bucket = 1
        while bucket <= busy[-1]:
            bucket *= 2
        bucket = min(bucket, self.slots)
        features = Features.of([row for row in self.rows[:bucket] if row is not None])
        with torch.no_grad():
            for _ in range(count):
                self._run(bucket, features)
                self.steps += 1

    def _run(self, bucket: int, features: Features) -> None:
        key = (bucket, features)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if not self.use_graphs:
            self._advance(bucket, features)
            return
        # A bucket's first step runs eagerly, on a side stream as capture wants (Triton compiles, cuBLAS
        # makes its handles), and is a real step; the capture records the next ones without running them.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._advance(bucket, features)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (NCCL's watchdog under torchrun, the server's event loop)
        # must not end this thread's capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._advance(bucket, features)
        self.graphs[key] = graph
        self.captures += 1

    def _advance(self, b: int, features: Features) -> None:
        """One step of slots [0, b): logits, the next token, every slot's state (graph-safe)."""
        logits = self.parts.step(
            self.tokens[:b],
            self.positions[:b],
            self.self_keys,
            self.self_values,
            self.cross_keys,
            self.cross_values,
            self.source_lengths[:b],
            self.bias,
        )
        chosen = self._choose(logits, b, features)
        was_done = self.done[:b]
        positions = self.positions[:b]
        chosen = torch.where(was_done, torch.full_like(chosen, self.pad), chosen)
        is_eos = (chosen[:, None] == self.eos[None, :]).any(-1)
        newly_done = ~was_done & (is_eos | (positions + 1 >= self.max_new[:b]))
        at = (positions + 1).clamp(max=self.length - 1)[:, None]
        history = self.history[:b]
        history.scatter_(1, at, torch.where(was_done[:, None], history.gather(1, at), chosen[:, None]))
        if features.penalty and self.presence is not None:
            self.presence[:b].scatter_(1, chosen[:, None], True)
        self.tokens[:b].copy_(chosen)
        self.positions[:b].add_((~was_done).long())
        self.done[:b].copy_(was_done | newly_done)

    def _choose(self, logits: torch.Tensor, b: int, features: Features) -> torch.Tensor:
        """The next token of each of the first b slots from its fp32 logits, through the processors."""
        minus_inf = float("-inf")
        if features.penalty and self.presence is not None:
            penalty = self.penalty[:b, None]
            penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
            logits = torch.where(self.presence[:b], penalised, logits)
        if features.ngram:
            logits = logits.masked_fill(self._ngram_bans(b, features.ngram), minus_inf)
        if features.min_new:
            too_early = self.positions[:b] < self.min_new[:b]
            logits = logits.masked_fill(too_early[:, None] & self.eos_mask[None, :], minus_inf)
        greedy = logits.argmax(-1)
        if not features.sample:
            return greedy
        scores = logits / self.temperature[:b, None]
        if features.truncate:
            ascending, order = scores.sort(dim=-1)
            k = self.top_k[:b].clamp(1, self.vocab)
            kth = ascending.gather(1, (self.vocab - k)[:, None])
            ascending = ascending.masked_fill(ascending < kth, minus_inf)
            cumulative = ascending.softmax(-1).cumsum(-1)
            outside = cumulative <= (1 - self.top_p[:b, None])
            outside[:, -1] = False
            scores = scores.scatter(1, order, ascending.masked_fill(outside, minus_inf))
        # Gumbel-max: argmax(scores + G), G = -log(-log(U)), picks token i with probability softmax(scores)_i
        uniform = torch.rand_like(scores)
        drawn = (scores - torch.log(-torch.log(uniform))).argmax(-1)
        return torch.where(self.sample[:b], drawn, greedy)

    def _ngram_bans(self, b: int, largest: int) -> torch.Tensor:
        """(b, vocab) True where a token would repeat an n-gram of its row (n: the row's
        no_repeat_ngram_size; 0: none), as NoRepeatNGramLogitsProcessor bans them."""
        history = self.history[:b]
        length = history.size(1)
        n = self.ngram[:b, None]
        fed = self.positions[:b, None]  # the token just fed sits at this position
        padded = torch.nn.functional.pad(history, (0, largest), value=-1)
        starts = torch.arange(length, device=history.device)[None, :]
        match = torch.ones_like(history, dtype=torch.bool)
        for i in range(largest - 1):  # the n-gram's first n - 1 tokens against the row's last n - 1
            prefix = history.gather(1, (fed - n + 2 + i).clamp(0, length - 1))
            match &= (padded[:, i : i + length] == prefix) | (i >= n - 1)
        match &= (starts <= fed - n + 1) & (n > 0)
        banned = padded.gather(1, starts + (n - 1).clamp(min=0))
        banned = torch.where(match, banned, self.vocab)  # column `vocab`: a bin for "no ban"
        bans = torch.zeros((b, self.vocab + 1), dtype=torch.bool, device=history.device)
        return bans.scatter_(1, banned, True)[:, : self.vocab]


def decode(
    model,
    prompts: Sequence[Sequence[int]],
    decoding: Decoding,
    *,
    max_batch_tokens: int,
    on_done: Callable[[int], None] | None = None,
    graphs: bool | None = None,
) -> tuple[list[list[int]], DecodingEngine]:
    """Each prompt's new tokens (through its end-of-sequence token), in input order, by the engine: as many
    slots as `max_batch_tokens` holds at (longest prompt + max_new_tokens + 1) tokens a slot, refilled as
    rows finish, longest prompts first. `on_done(rows)` after rows finish. Returns the engine too (its
    counts: steps, captures, cache bytes)."""
    source = max(1, max((len(p) for p in prompts), default=1))
    per_slot = source + decoding.max_new_tokens + 1
    slots = max(1, min(len(prompts), max_batch_tokens // per_slot))
    engine = DecodingEngine(
        model, slots=slots, max_source_tokens=source, max_new_tokens=decoding.max_new_tokens, graphs=graphs
    )
    log.debug(
        "decoding %d prompts in %d slots (caches %.2f GiB)%s",
        len(prompts),
        slots,
        engine.cache_bytes / 2**30,
        ", CUDA graphs" if engine.use_graphs else "",
    )
    waiting = deque(sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i)))
    held: dict[int, int] = {}  # slot -> prompt index
    out: list[list[int]] = [[] for _ in prompts]
    refill_at = max(1, slots // 8)  # the encoder runs for several joining prompts at once
    while waiting or held:
        free = engine.free_slots()
        if waiting and (len(free) >= refill_at or not held):
            joining = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
            engine.start(free[: len(joining)], [prompts[i] for i in joining], [decoding] * len(joining))
            held.update(zip(free, joining, strict=False))
        engine.step(STEPS_PER_CHECK)
        finished = engine.finished()
        for slot in finished:
            out[held.pop(slot)] = engine.take(slot)
        if finished and on_done is not None:
            on_done(len(finished))
    return out, engine
