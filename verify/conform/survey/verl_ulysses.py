#!/usr/bin/env python3
"""verl 0.9.1's Ulysses sequence-parallel SFT loss path on Gloo ranks on the CPU, called as its FSDP engine calls it
(verl/workers/engine/fsdp/transformer_impl.py: forward_backward_batch, prepare_model_inputs, prepare_model_outputs;
the SFT trainer's loss verl/workers/utils/losses.py sft_loss). Usage: verl_ulysses.py CASE_DIR

Per rank, with verl's own functions: the rows packed into one sequence without padding (use_remove_padding, which
verl requires under SP), apply_monkey_patch(model, ulysses_sp_size=W) (its all-to-all around the flash-attention
call), ulysses_pad_and_slice_inputs for the input ids, position ids and rolled ids, logprobs_from_logits on the
shard, gather_outputs_and_unpad (the gather whose backward scales by W), sft_loss over the step's target count
(batch_num_tokens) times dp_size (1), backward per micro-batch. The rank gradients are then averaged over the W
ranks, as FSDP's reduction over verl's mesh of dp x sp ranks does (the adapter re-states that mean: FSDP is not run).
The one stand-in: the CUDA flash-attention varlen kernel under verl's Ulysses wrapper is replaced by exact causal
attention per packed sequence (sequences start where position_ids is 0), which the CPU can run in fp64.
A packed case's sequences are verl's samples (cut out of the packed rows), each packed again by verl's own path.
A row's first token is never a target (HF's shift drops it; verl's datasets mask it: its loss_mask is rolled by one,
so a first-token target would be predicted from the previous row's last token). Labels must be the input ids.
The case's ranks (rows or positions split, as deepspeed_ulysses.py) are the SP degree, one SP group (dp = 1);
VERL_SP: the degree for a case with "ranks" 1 (default 2). VERL_GRAD_SCALER_OFF=1: the negative control (the
gather without its backward's xW: every gradient 1/W).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # verify/conform: the streambp_conform package (no torch at import)
from streambp_conform.protocol import declines_rl_step  # noqa: E402


def launch(case_dir):
    if (declined := declines_rl_step(case_dir)) is not None:  # before torchrun, which reports a rank's 3 as 1
        return declined
    ranks = int(json.loads((Path(case_dir) / "case.json").read_text()).get("ranks", 1))
    sp = ranks if ranks > 1 else int(os.environ.get("VERL_SP", "2"))
    config = json.loads((Path(case_dir) / "model" / "config.json").read_text())
    heads = (config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]))
    if heads[0] % sp or (heads[1] % sp and sp % heads[1]):  # verl's assertion in apply_monkey_patch, said early
        print(f"{Path(case_dir).name}: {heads[0]} query / {heads[1]} KV heads on {sp} ranks: Ulysses splits heads",
              file=sys.stderr)
        return 3  # protocol.NOT_EXPRESSIBLE (torchrun would report a rank's 3 as 1)
    port = str(29500 + os.getpid() % 2000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(sp),
           "--master_addr", "127.0.0.1", "--master_port", port, str(HERE), "--worker", case_dir]
    return subprocess.call(cmd, env=dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")))


def varlen_causal_attention(q, k, v, attention_mask, query_length, *args, position_ids=None, softmax_scale=None,
                            is_causal=True, **kwargs):
    """The flash-attention varlen call's result, exactly, on the CPU: q [1, S, H, D], k/v [1, S, Hkv, D]; causal
    within each packed sequence (a new one where position_ids is 0)."""
    import torch

    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise NotImplementedError("sliding window / softcap: not in the survey's models")
    seg = torch.cumsum((position_ids[0] == 0).long(), 0)
    S = q.shape[1]
    i = torch.arange(S)
    allowed = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhst,bthd->bshd", probs, v)


def worker(case_dir):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE.parents[1]))
    sys.path.insert(0, str(HERE.parent))
    import packed_rows
    import protocol

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        case = protocol.read_case(case_dir, accumulates=True, distributed=True, packs=True)
        if case.objective["name"] != "sft":
            raise protocol.NotExpressible(f"{case.objective['name']}: this adapter runs verl's SFT loss only")
        b = case.batch
        valid = b["attention_mask"].bool() if "attention_mask" in b else torch.ones_like(b["input_ids"], dtype=bool)
        targets = b["labels"] != -100
        if (targets & (b["labels"] != b["input_ids"])).any():
            raise protocol.NotExpressible("labels other than the input ids: verl's targets are the next input ids")
        model, trainable = protocol.load_model(case)
    except Exception as e:  # CaseError -> 2, NotExpressible -> 3, the rest a crash
        if rank == 0:
            print(f"{Path(case_dir).name}: {type(e).__name__}: {e}", file=sys.stderr)
        if isinstance(e, protocol.NotExpressible):
            return protocol.NOT_EXPRESSIBLE
        if isinstance(e, protocol.CaseError):
            return 2
        raise

    from tensordict import TensorDict
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import flash_attention_mask

    import verl.models.transformers.monkey_patch as verl_patch
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.utils.torch_functional import logprobs_from_logits
    from verl.utils.ulysses import gather_outputs_and_unpad, set_ulysses_sequence_parallel_group, \
        ulysses_pad_and_slice_inputs
    from verl.workers.utils.losses import sft_loss

    # HF's flash-attention integration under its own name (no flash_attn package on the CPU), verl's Ulysses wrapper
    # patched into it by verl, and the exact CPU attention under that wrapper
    AttentionInterface.register("verl_cpu_varlen", flash_attention_forward)
    AttentionMaskInterface.register("verl_cpu_varlen", flash_attention_mask)
    model.set_attn_implementation("verl_cpu_varlen")
    verl_patch.is_trl_available = lambda: False  # the harness venv's trl 1.16 has no PPO value head for it to patch
    set_ulysses_sequence_parallel_group(dist.new_group(list(range(world))))  # dp = 1: the one sp group is the world
    apply_monkey_patch(model, ulysses_sp_size=world, use_remove_padding=True)
    verl_patch._flash_attention_forward = varlen_causal_attention
    scaler = not os.environ.get("VERL_GRAD_SCALER_OFF")

    loss_mask = targets & valid
    if getattr(case, "packed", False):  # verl's samples are the packed sequences: its remove-padding path packs them again itself
        rows, micro = packed_rows.sequences(case)
        samples = [(torch.tensor(r["input_ids"]), torch.tensor(r["labels"]) != -100) for r in rows]
    else:
        micro = case.micro_batches or [list(range(b["input_ids"].shape[0]))]
        samples = [(b["input_ids"][r][valid[r]], loss_mask[r][valid[r]]) for r in range(b["input_ids"].shape[0])]
    for _, mask in samples:
        mask[0] = False  # a sample's first token is never a target (the docstring)
    batch_num_tokens = sum(int(mask.sum()) for _, mask in samples)  # forward_backward_batch: the step's targets

    def micro_loss(rows):
        ids = [samples[r][0] for r in rows]
        masks = [samples[r][1].long() for r in rows]
        offsets = torch.tensor([0] + [len(x) for x in ids]).cumsum(0)
        ids_rmpad = torch.cat(ids).unsqueeze(0)
        pos_rmpad = torch.cat([torch.arange(len(x)) for x in ids]).unsqueeze(0)
        rolled = torch.roll(ids_rmpad, shifts=-1, dims=1)
        ids_l, pos_l, pad = ulysses_pad_and_slice_inputs(ids_rmpad, pos_rmpad, sp_size=world)
        rolled_l, _, _ = ulysses_pad_and_slice_inputs(rolled, None, sp_size=world)
        logits = model(input_ids=ids_l, attention_mask=None, position_ids=pos_l, use_cache=False).logits.squeeze(0)
        log_probs = logprobs_from_logits(logits=logits, labels=rolled_l.squeeze(0), inplace_backward=True)
        log_probs = gather_outputs_and_unpad(log_probs, gather_dim=0, unpad_dim=0, padding_size=pad,
                                             grad_scaler=scaler)
        data = TensorDict({"loss_mask": torch.nested.nested_tensor_from_jagged(torch.cat(masks), offsets)},
                          batch_size=[len(rows)])
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=batch_num_tokens, pad_mode=DatasetPadMode.NO_PADDING)
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, offsets)}
        return sft_loss(config=None, model_output=out, data=data)[0]

    for p in trainable.values():
        p.grad = None
    loss = 0.0
    for rows in micro:
        part = micro_loss(rows)
        part.backward()
        loss += part.item()
    grads = {n: p.grad.detach().contiguous() for n, p in trainable.items()}
    for g in grads.values():  # FSDP's reduction over verl's dp x sp mesh: the mean over its ranks
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        g.div_(world)
    if rank == 0:  # every sp rank holds the same loss (the gathered log-probs); verl logs rank 0's
        steps = len(case.micro_batches) if case.micro_batches else None
        protocol.write_outputs(case, loss, grads, micro_batches=steps)
    dist.barrier()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    if len(sys.argv) != 2:
        print("Usage: verl_ulysses.py CASE_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(sys.argv[1]))
