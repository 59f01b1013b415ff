"""How much a checkpoint write slows the GPU work running beside it: the decoding engine's generation (an
evaluation) alone, then beside a write.

    python3 bench/writer_overlap.py                   # GPU: XL's shape, random weights, a 16 GiB write
    python3 bench/writer_overlap.py --trainer-writer  # GPU: the trainer's own background save
    python3 bench/writer_overlap.py --tiny            # CPU check of the script

Plain: dcp.save of host tensors the size of XL's checkpoint, then the weights through safetensors' save_file,
repeated until the generation ends, from a thread of the same process and from another process.
`--trainer-writer`: trainer.checkpoint.writer's save of the model with Adafactor + Kahan states, as the
training loop saves (gather, stage into pinned buffers, write in its thread), the whole checkpoint and then
dcp/ alone (no model.safetensors). Printed: the generation's seconds in each case and the ratio to alone; with
--trainer-writer also the host memory the staged copy page-locks, beside what PyTorch's pinned allocator holds
for the same buffers.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import threading
import time
import warnings

import torch


def write_loop(tensors: dict, weights: list[str], work: str, stop) -> None:
    """Write the checkpoint's files over and over until `stop` is set."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    warnings.filterwarnings("ignore", "Detected an existing checkpoint")
    while not stop.is_set():
        dcp.save(tensors, checkpoint_id=f"{work}/dcp", no_dist=True)
        save_file({k: tensors[k] for k in weights}, f"{work}/model.safetensors")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--gib", type=float, default=16.0, help="size of the checkpoint written")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--trainer-writer", action="store_true", help="trainer.checkpoint.writer's own save")
    args = ap.parse_args()

    from transformers import AutoModelForSeq2SeqLM

    from trainer.eval.decoding import Decoding, decode
    from trainer.eval.generate import prepare_for_generation
    from trainer.model.model_files import dtype_kwarg
    from trainer.model.swaps import use_fused_t5_ops
    from trainer.model.tiny_model import flan_t5_config

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = flan_t5_config("tiny" if args.tiny else "xl", vocab_size=32128)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForSeq2SeqLM.from_config(config, **{dtype_kwarg(): dtype}).eval()
    use_fused_t5_ops(model)
    model = prepare_for_generation(model)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(5, 32000, (int(n),), generator=g).tolist() for n in torch.randint(40, 200, (64,))
    ]
    new_tokens = 8 if args.tiny else args.new_tokens
    decoding = Decoding(max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def generation_s() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            decode(model, prompts, decoding, max_batch_tokens=8192 if args.tiny else 32768)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    generation_s()  # compilation and captures
    alone = generation_s()
    print(
        f"{'FLAN-T5-XL' if not args.tiny else 'tiny'} shape on {device}; 64 prompts x {new_tokens} new "
        "tokens; a checkpoint written beside it",
        flush=True,
    )
    print(f"generation alone: {alone:.2f} s", flush=True)
    if args.trainer_writer:
        trainer_writer(model, device, generation_s, alone)
        return 0
    # Host tensors as a staged checkpoint: the weights, then copies of them up to --gib (Kahan, states), all
    # views of one shared buffer (as a staging arena: one mapping for the other process, not one per tensor).
    state = {k: v.detach() for k, v in model.state_dict().items()}
    names = _untied(state)
    size = sum(state[k].numel() * state[k].element_size() for k in names)
    copies = 1 if args.tiny else max(1, round(args.gib * 2**30 / size))
    arena = torch.empty(copies * size, dtype=torch.uint8).share_memory_()
    tensors, offset = {}, 0
    for c in range(copies):
        for k in names:
            n = state[k].numel() * state[k].element_size()
            view = arena[offset : offset + n].view(state[k].dtype).view(state[k].shape)
            view.copy_(state[k])
            tensors[k if c == 0 else f"copy{c}.{k}"] = view
            offset += n
    print(f"the plain write: {arena.numel() / 2**30:.1f} GiB", flush=True)
    with tempfile.TemporaryDirectory(prefix="writer-overlap-") as work:
        for kind in ("thread", "process"):
            if kind == "thread":
                stop = threading.Event()
                writer = threading.Thread(target=write_loop, args=(tensors, names, work, stop), daemon=True)
            else:
                ctx = multiprocessing.get_context("spawn")
                stop = ctx.Event()
                writer = ctx.Process(target=write_loop, args=(tensors, names, work, stop), daemon=True)
            writer.start()
            time.sleep(5.0 if kind == "process" else 1.0)  # the process imports torch first
            seconds = generation_s()
            stop.set()
            writer.join()
            print(f"generation while a {kind} writes: {seconds:.2f} s ({seconds / alone:.2f}x)", flush=True)
    return 0


def trainer_writer(model, device, generation_s, alone: float) -> None:
    """The generation while trainer.checkpoint.writer writes a checkpoint of `model` with Adafactor + Kahan
    states, as the training loop saves: the whole checkpoint, then dcp/ alone."""
    import dataclasses

    from trainer.checkpoint import store, writer
    from trainer.checkpoint.store import gather_checkpoint
    from trainer.config import TrainConfig
    from trainer.optim import build_optimizer

    cfg = TrainConfig(train_files=["x"], optimizer="adafactor", bf16_update="kahan")
    optimizer = build_optimizer(model, cfg, device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with tempfile.TemporaryDirectory(prefix="writer-overlap-") as work:
        saver = writer.CheckpointWriter(background=True)
        for step, case in enumerate(("as the trainer writes", "without model.safetensors"), 1):
            contents = gather_checkpoint(
                work, step, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}
            )
            if case == "without model.safetensors":
                contents = dataclasses.replace(contents, weights=None, model=None)
            started = time.perf_counter()
            saver.save(contents)
            paused = time.perf_counter() - started
            time.sleep(1.0)
            seconds = generation_s()
            saver.wait()
            print(
                f"generation while the trainer's writer writes ({case}): {seconds:.2f} s "
                f"({seconds / alone:.2f}x); the save paused {paused:.2f} s, wrote in "
                f"{time.perf_counter() - started:.1f} s",
                flush=True,
            )
        if device.type == "cuda":
            print(host_memory_line(saver._stager, store.state_dicts(model, optimizer)), flush=True)
        saver.close()


def host_memory_line(stager, dcp_state: dict) -> str:
    """The page-locked host memory the stager holds for the checkpoint's tensors, and what PyTorch's pinned
    allocator holds for buffers of the same shapes (measured: they are allocated, then freed)."""
    from trainer.checkpoint.writer import _skeleton, tensor_bytes

    locked = sum(b.untyped_storage().nbytes() for b in stager._buffers if b.is_pinned())
    stats = torch.cuda.host_memory_stats
    before = stats().get("allocated_bytes.current", 0)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in _skeleton(dcp_state)[1]]
    by_allocator = stats().get("allocated_bytes.current", 0) - before
    del pinned
    gib, needed = 2**30, tensor_bytes(dcp_state)
    return (
        f"host memory of the staged copy: {locked / gib:.2f} GiB page-locked for {needed / gib:.2f} GiB of "
        f"tensors; PyTorch's pinned allocator holds {by_allocator / gib:.2f} GiB for the same buffers"
    )


def _untied(weights: dict) -> list[str]:
    """One name per storage (safetensors refuses shared tensors)."""
    seen, names = set(), []
    for k, v in weights.items():
        if v.untyped_storage().data_ptr() not in seen:
            seen.add(v.untyped_storage().data_ptr())
            names.append(k)
    return names


if __name__ == "__main__":
    raise SystemExit(main())
