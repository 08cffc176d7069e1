# What a user meets away from the repository (issue #30, item 7), each run from a fresh folder outside it:
# (a) docs/objectives.md's LoRA recipe, scaled to tiny: the second command reads the base, the adapter and the batch the
#     first one wrote, and its adapter gradients equal the first one's (fp64, another method);
# (b) `project` finds the harness's own measured runs for its error bars (results/grid of the checkout the binary was
#     built from);
# (c) a command's results go under the current directory, and its last line prints that folder in full.
source "$(dirname "$0")/../support/cli_common.sh"
SRC=$(cd "$(dirname "$0")/../.." && pwd)

# (a)
"$STREAMBP" run --preset tiny --dtype fp64 --method streambp:layer_chunk=16,head_chunk=16 --seq 64 \
  --lora rank=4,alpha=8,targets=all-linear,init=random \
  --save-model base-dir --save-adapter my-adapter --save-batch batch.safetensors --save-grads adapter-grads.safetensors \
  >first.txt 2>&1 || fail "the first LoRA command of docs/objectives.md:\n$(cat first.txt)"
"$STREAMBP" run --load base-dir --adapter my-adapter --batch-file batch.safetensors --method mst --dtype fp64 \
  --save-grads again.safetensors >second.txt 2>&1 || fail "the second LoRA command of docs/objectives.md:\n$(cat second.txt)"
"$STREAMBP" compare adapter-grads.safetensors again.safetensors --rtol 1e-10 >compare.txt ||
  fail "the LoRA recipe's two runs disagree:\n$(cat compare.txt)"
echo "ok: docs/objectives.md's LoRA recipe runs as written (scaled to tiny) and its two runs agree"

# (b)
"$STREAMBP" project --out p >project.txt 2>&1 || fail "project:\n$(cat project.txt)"
if [[ -d $SRC/results/grid ]]; then
  grep -qF "over the CPU runs in $SRC/results/grid" project.txt ||
    fail "project run outside the checkout did not find $SRC/results/grid:\n$(head -5 project.txt)"
  echo "ok: project outside the checkout takes its error bars from $SRC/results/grid"
fi
expect_exit_2 "project --errors of a missing folder" "--errors no-such-dir: no such folder" \
  "$STREAMBP" project --errors no-such-dir --out p2

# (c)
"$STREAMBP" toy --rows 64 --dim 8 --partitions 1,4 --repeats 1 >toy.txt 2>&1 || fail "toy:\n$(cat toy.txt)"
grep -qF "results: $(pwd -P)/results/partition/toy-" toy.txt || fail "toy does not print where it wrote in full:\n$(tail -3 toy.txt)"
echo "ok: toy wrote under the current directory and printed $(grep -o "/[^ ]*/results/partition/[^ ]*" toy.txt)"
