"""Scale check (not a test): generate N recipes, index them, stream one full shuffled epoch, resume mid-epoch.

Each phase runs in its own process so its peak RSS (ru_maxrss) is its own. The issue's goals: peak RSS < 1 GiB
for a full pass over 6M recipes, resume mid-epoch in < 30 s.

usage: python bench/loader_scale.py --tokenizer DIR_OR_TOKENIZER_JSON [--n 6000000] [--dir /tmp/loader-scale]
       [--max-tokens 8192] [--keep]

The data (about 1.05 GB per million recipes, RecipeNLG CSV) and the index cache go to --dir, which is removed
at the end unless --keep; an existing data file of the right name is reused (generation is then not timed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def stream(a: argparse.Namespace):
    from trainer.data.loader import RecipeStream

    return RecipeStream(
        a.data,
        a.tokenizer,
        max_tokens=a.max_tokens,
        pad_to_multiple_of=8,
        shuffle=True,
        seed=0,
        cache_dir=Path(a.dir) / "cache",
    )


def digest(batch) -> str:
    h = hashlib.sha256()
    for k in ("input_ids", "attention_mask", "labels"):
        h.update(batch[k].tobytes())
    return h.hexdigest()[:16]


def phase(a: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    if a.phase == "sample":
        from trainer.data.sample import write_sample

        write_sample(a.data, a.n, seed=0, fmt="recipenlg-csv")
        return {"seconds": time.perf_counter() - t0}
    s = stream(a)
    opened = time.perf_counter() - t0
    if a.phase == "index":
        st = s.stats()
        return {
            "seconds": opened,
            "records": st["records"],
            "skipped": st["skipped"],
            "cached": st["index_cached"],
        }
    if a.phase == "pass":
        mid = len(s) // 2
        t1 = time.perf_counter()
        records = batches = 0
        at_mid = None
        for b in s:
            if batches == mid:
                at_mid = digest(b)
            records += len(b["input_ids"])
            batches += 1
        st = s.stats()
        return {
            "open_s": opened,
            "seconds": time.perf_counter() - t1,
            "records": records,
            "batches": batches,
            "real_token_share": st["real_token_share"],
            "mid": mid,
            "mid_digest": at_mid,
            "fingerprint": s.state_dict()["fingerprint"],
        }
    # resume: a fresh process continues at batch `mid` of epoch 0, as after a restart.
    s.load_state_dict({"epoch": 0, "batches_consumed": a.mid, "fingerprint": a.fingerprint})
    first = digest(next(iter(s)))
    return {"seconds": time.perf_counter() - t0, "open_s": opened, "digest": first}


def run(a: argparse.Namespace, name: str, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--phase", name, "--tokenizer", a.tokenizer, "--n", str(a.n)]
    cmd += ["--dir", a.dir, "--max-tokens", str(a.max_tokens), *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    print(f"{name:7} {json.dumps(res)}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--n", type=int, default=6_000_000)
    ap.add_argument("--dir", default="/tmp/loader-scale")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--phase", choices=["sample", "index", "pass", "resume"])
    ap.add_argument("--mid", type=int)
    ap.add_argument("--fingerprint")
    a = ap.parse_args()
    a.data = str(Path(a.dir) / f"recipes-{a.n}.csv")
    if a.phase:
        res = phase(a)
        res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    try:
        gen = None if Path(a.data).exists() else run(a, "sample")
        size_gb = Path(a.data).stat().st_size / 1e9
        idx = run(a, "index")
        full = run(a, "pass")
        res = run(a, "resume", "--mid", str(full["mid"]), "--fingerprint", full["fingerprint"])
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    peak = max(r["peak_rss_mib"] for r in (gen, idx, full, res) if r)
    print(
        f"\n{a.n} generated recipes (RecipeNLG CSV, {size_gb:.2f} GB), "
        f"max_tokens={a.max_tokens}, shuffled, 1 process"
    )
    print(f"{'step':32} {'seconds':>8} {'recipes/s':>10} {'peak RSS MiB':>13}")
    rows = [("generate (trainer data sample)", gen, a.n)] if gen else []
    rows += [
        ("index (first open)", idx, idx["records"]),
        ("full epoch (cached index)", full, full["records"]),
    ]
    for name, r, n in rows:
        print(f"{name:32} {r['seconds']:>8.1f} {n / r['seconds']:>10.0f} {r['peak_rss_mib']:>13.0f}")
    print(
        f"{'resume at batch ' + str(full['mid']):32} {res['seconds']:>8.1f} {'':>10} "
        f"{res['peak_rss_mib']:>13.0f}"
    )
    print(
        f"reopen with cached index: {full['open_s']:.1f} s; real-token share {full['real_token_share']:.3f}"
    )
    print(f"resumed batch identical to the uninterrupted one: {res['digest'] == full['mid_digest']}")
    print(f"peak RSS over all steps: {peak:.0f} MiB (goal < 1024)")


if __name__ == "__main__":
    main()
