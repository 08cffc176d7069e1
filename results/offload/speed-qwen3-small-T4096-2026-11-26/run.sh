B=${STREAMBP:-build/streambp}
for round in 1 2; do
for m in streambp checkpoint mst; do
  for o in plain offload; do
    extra=(); [[ $o == offload ]] && extra=(--offload checkpoints --offload-dir .)
    $B run --preset qwen3-small --seq 4096 --method $m --threads 2 --warmup 1 --repeats 2 "${extra[@]}" --json "r$round-$m-$o.json" --force > "r$round-$m-$o.txt" 2>&1
  done
done
done
