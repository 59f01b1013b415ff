#!/usr/bin/env bash
# Does the suite still catch what matters? Five deliberate defects, each planted alone in a scratch worktree of
# HEAD and run against the tests that own the area; prints which tests fail (each must fail). bench/NOTES.md
# (2026-12-02) has the results. Needs `make install` first (the venv and the built extension); 12-15 minutes on
# 2 cores. Usage: bench/planted_defects.sh [NAME...]   (names: resume shuffle serve secret kahan)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/planted-defects.XXXXXX)
trap 'git -C "$repo" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$repo" worktree add -q --detach "$work/tree" HEAD
cp "$repo"/trainer/_loader*.so "$work/tree/trainer/"
cd "$work/tree"
export PYTHONPATH=$work/tree  # the worktree's trainer, not the checkout's editable install
pytest=("$repo/.venv/bin/pytest" -q -n auto -p no:cacheprovider)

plant() {  # plant FILE OLD NEW: replace the one occurrence of OLD
  python3 - "$@" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, f"{path}: the line to change is not there once: {old}"
open(path, "w").write(text.replace(old, new))
PY
}

check() {  # check NAME COMMAND...: run, list the failures, revert; a defect nothing catches is an error
  local name=$1 log=$work/$1.log
  shift
  if "$@" >"$log" 2>&1; then
    echo "$name: NOT CAUGHT ($*)"
    status=1
  else
    echo "$name: caught by"
    grep -E "^FAILED|^test .* FAILED$" "$log" | sed 's/^/  /'
  fi
  git checkout -q -- .
}

status=0
wanted=${*:-resume shuffle serve secret kahan}
for name in $wanted; do
  case $name in
    resume)
      plant trainer/run/run_state.py 'step = int(saved["step"])' 'step = int(saved["step"]) + 1'
      check "resume one step off" "${pytest[@]}" -m "not slow" tests/test_train.py tests/test_checkpoint.py \
        tests/test_cli.py tests/test_faults.py ;;
    shuffle)
      plant rust_loader/core/src/stream.rs '        self.pos = s.batches_consumed as usize;' \
        '        self.pos = (s.batches_consumed as usize).saturating_sub(1);'
      check "the shuffle repeats records after a resume" \
        env CARGO_TARGET_DIR="$repo/target" cargo test --release -p recipe_core ;;
    serve)
      plant trainer/eval/generate.py '"never repeat an n-gram of this size (0: off)", 0, MAX_NO_REPEAT_NGRAM' \
        '"never repeat an n-gram of this size (0: off)", 0, None'
      check "a serve option without its bound" "${pytest[@]}" tests/test_serve.py tests/test_generate.py \
        -k "not browser" ;;
    secret)
      plant trainer/report/reporter.py '        self._discord = DiscordNotifier(url)' \
        "        print(f\"Discord notifications to {url}\", file=__import__(\"sys\").stderr)
        self._discord = DiscordNotifier(url)"
      check "a secret on the console" "${pytest[@]}" -m "not slow" tests/test_report.py tests/test_notify.py \
        tests/test_faults.py ;;
    kahan)
      plant trainer/plan/memory_plan.py \
        '        states += shape.sharded_params(shards) * kahan_buffer_bytes(spec, e, bf16_update)' \
        '        states += 0 * shape.sharded_params(shards) * kahan_buffer_bytes(spec, e, bf16_update)'
      check "the memory plan without the Kahan buffer" "${pytest[@]}" tests/test_memory_plan.py \
        tests/test_optim.py tests/test_presets.py ;;
    *) echo "unknown defect $name (resume shuffle serve secret kahan)" >&2; exit 2 ;;
  esac
done
exit $status
