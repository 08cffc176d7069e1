"""The adapter side of the conformance file protocol "streambp-conform/1" (ARCHITECTURE.md §13, docs/conformance.md): what
every shipped adapter shares, so that each adapter is only its loss.

`streambp conform` writes a case directory and runs `ADAPTER CASE_DIR`:
  model/              HF checkpoint (config.json + safetensors): qwen3, or qwen2/llama when the case has no qk-norm
  adapter/            LoRA cases only: a PEFT adapter folder
  batch.safetensors   input_ids, attention_mask [B, T] int64 (right padding) + the objective's tensors
  case.json           {"protocol", "case", "dtype", "objective", "lora", "chunks": {"layer", "head"}, "ranks",
                      "parallel", ...} ("ranks" > 1: a distributed implementation runs that many processes itself and
                      returns the whole batch's gradients, those rank 0's optimizer would see; "parallel": how the
                      ranks split the work, "data" (each rank its rows; also what a one-process case says) or
                      "sequence" (each rank its positions of every row, the library splitting the sequence and
                      aggregating the loss its own way; ranks >= 2), and in a micro-batch case "micro_batches":
                      [[row, ...], ...], the optimizer step's micro-batches, each the batch rows it holds (DPO: its
                      chosen rows, then their rejected rows in the same order); the step's gradient is the trainer's
                      after all of them
The adapter writes, each atomically (a killed adapter leaves no half file):
  grads.safetensors   d loss / d every trainable tensor in the model dtype: HF parameter names (a tied lm_head only
                      as model.embed_tokens.weight) or, under LoRA, PEFT's saved adapter names
  result.json         {"loss": float, "seconds": float}  (seconds: forward + backward); in a micro-batch case also
                      "micro_batches": int, how many the step ran (the harness checks it against the case's)
"""
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROTOCOL = "streambp-conform/1"
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


class CaseError(Exception):
    """A malformed case or one this adapter cannot run: exit 2 with the message (the harness reports it)."""


class NotExpressible(Exception):
    """A well-formed case the wrapped library cannot express (a model family, a loss, a distributed layout it does not
    have): exit 3 with the reason as the last line; the harness reports the case as not expressible, neither passed
    nor failed."""


NOT_EXPRESSIBLE = 3


@dataclass
class Case:
    dir: Path
    name: str
    dtype: torch.dtype
    objective: dict   # {"name": "sft"|"grpo"|"dpo", ...TRL config names}
    lora: bool
    head_chunk: int   # the suggested sequence chunk of the LM head (chunked implementations; plain ones ignore it)
    batch: dict       # tensor name -> tensor, as in batch.safetensors
    layer_chunk: int = 0  # the suggested chunk (tile) of a layer's sequence
    ranks: int = 1        # processes a distributed implementation runs (case.json "ranks")
    parallel: str = "data"  # how the ranks split the work: "data" (rows) or "sequence" (positions)
    micro_batches: list = None  # the step's micro-batches, each a list of rows (case.json "micro_batches"); None: one
    union: dict = None    # on a micro-batch's Case (micro_case): the whole step's batch, whose totals normalise


def read_case(case_dir, accumulates=False):
    """The case; a micro-batch case is NotExpressible unless the caller `accumulates` (runs the step's micro-batches
    into one gradient, normalised by the step's totals: run_step with a loss that reads Case.union)."""
    case_dir = Path(case_dir)
    try:
        meta = json.loads((case_dir / "case.json").read_text())
    except (OSError, ValueError) as e:
        raise CaseError(f"{case_dir}/case.json: {e}")
    if meta.get("protocol") != PROTOCOL:
        raise CaseError(f"{case_dir}/case.json: protocol {meta.get('protocol')!r}, this adapter speaks {PROTOCOL!r}")
    if meta.get("dtype") not in DTYPES:
        raise CaseError(f"{case_dir}/case.json: dtype {meta.get('dtype')!r} (one of {', '.join(DTYPES)})")
    objective = meta.get("objective") or {}
    if objective.get("name") not in ("sft", "grpo", "dpo"):
        raise CaseError(f"{case_dir}/case.json: objective {objective!r} (name sft, grpo or dpo)")
    batch = load_file(str(case_dir / "batch.safetensors"))
    for key in ("input_ids", "attention_mask"):
        if key not in batch:
            raise CaseError(f"{case_dir}/batch.safetensors: no tensor {key!r}")
    chunks = meta.get("chunks") or {}
    parallel = meta.get("parallel", "data")  # absent in files written before the protocol had it: rows
    if parallel not in ("data", "sequence"):
        raise CaseError(f"{case_dir}/case.json: parallel {parallel!r} (data or sequence)")
    micro = meta.get("micro_batches")
    if micro is not None and not accumulates:
        raise NotExpressible(f"{len(micro)} micro-batches: this adapter runs one batch per optimizer step")
    return Case(case_dir, meta.get("case", case_dir.name), DTYPES[meta["dtype"]], objective, bool(meta.get("lora")),
                int(chunks.get("head") or batch["input_ids"].size(1)), batch,
                int(chunks.get("layer") or batch["input_ids"].size(1)), int(meta.get("ranks", 1)), parallel=parallel,
                micro_batches=micro)


def micro_case(case, rows):
    """The Case of one micro-batch: its rows of every batch tensor, and the whole step's batch as `union`."""
    index = torch.tensor(rows, dtype=torch.long)
    return replace(case, batch={k: v.index_select(0, index) for k, v in case.batch.items()}, union=case.batch)


def quiet_hf():
    """HF and PEFT print progress bars and deprecation notes on stderr; the harness keeps stderr for real errors."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def patch_rms_norms_for_fp64():
    """HF's RMSNorm rounds its statistics to fp32 even in an fp64 model (`.to(torch.float32)`), which puts an fp64 HF
    run ~1e-7 from an exact fp64 computation. Upcast to *at least* fp32 instead: fp64 stays fp64, and fp32/bf16 are
    unchanged (the same patch as tests/oracle/hf_parity.py). Applied in fp64 cases only."""
    import importlib

    for module, cls_name in (("qwen3", "Qwen3RMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("llama", "LlamaRMSNorm")):
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls_name)

        def forward(self, x):
            xc = x.to(torch.promote_types(x.dtype, torch.float32))
            xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * xc.to(x.dtype)

        cls.forward = forward


def saved_peft_name(name):
    """named_parameters() carries the adapter name ("lora_A.default.weight"); PEFT's saved files do not."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def load_model(case, gradient_checkpointing=False):
    """HF's AutoModelForCausalLM on model/ in the case dtype (PEFT-wrapped under LoRA), and its trainable tensors by
    the names grads.safetensors must use. Train mode only with checkpointing (HF checkpoints only in training);
    dropout is 0 in the harness's configs, checked here, so both modes compute the same function."""
    import transformers

    quiet_hf()
    if case.dtype == torch.float64:
        patch_rms_norms_for_fp64()
    config = json.loads((case.dir / "model" / "config.json").read_text())
    # The harness's own keys beside HF's (core/model/config.cpp): HF's Qwen3 always has q/k norms and puts
    # attention_bias on o_proj too; a config that says otherwise describes a model HF cannot build.
    if config.get("model_type") == "qwen3" and (config.get("qk_norm") is False or
                                                config.get("o_proj_bias", config.get("attention_bias")) != config.get("attention_bias")):
        raise CaseError("config.json: qwen3 without qk-norm, or with o_proj_bias != attention_bias, has no HF class")
    model = transformers.AutoModelForCausalLM.from_pretrained(case.dir / "model", dtype=case.dtype,
                                                              attn_implementation="sdpa")
    if getattr(model.config, "attention_dropout", 0.0) != 0.0:
        raise CaseError(f"config.json: attention_dropout {model.config.attention_dropout} makes gradients random")
    model.config.use_cache = False
    if gradient_checkpointing:  # before PEFT: HF's checkpointing lives on the decoder layers of the base model
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()  # non-reentrant torch.utils.checkpoint (HF's default): works with a frozen base under LoRA
        if not any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
            raise CaseError("HF did not turn gradient checkpointing on for this model")
    if case.lora:
        from peft import PeftModel

        adapter_dir = case.dir / "adapter"
        if json.loads((adapter_dir / "adapter_config.json").read_text()).get("lora_dropout", 0.0) != 0.0:
            raise CaseError("adapter_config.json: lora_dropout > 0 makes gradients random")
        # autocast_adapter_dtype=False: PEFT would otherwise hold bf16 adapters in fp32; the case dtype is judged
        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True, autocast_adapter_dtype=False)
        trainable = {saved_peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
        if set(saved) != set(trainable):  # PEFT only warns on missing/unexpected keys
            raise CaseError(f"adapter: file vs PEFT's trainable tensors differ: {sorted(set(saved) ^ set(trainable))[:6]}")
        wrong = {n: p.dtype for n, p in trainable.items() if p.dtype != case.dtype}
        if wrong:
            raise CaseError(f"adapter: PEFT holds {len(wrong)} tensors in another dtype than {case.dtype}: {wrong}")
    else:
        trainable = dict(model.named_parameters())  # a tied lm_head appears once, as model.embed_tokens.weight
    model.train(gradient_checkpointing)
    return model, trainable


def run_step(case, model, trainable, loss_fn):
    """loss_fn(model, case) -> scalar loss; one forward + backward, timed. A micro-batch case: one per micro-batch
    (loss_fn gets micro_case's Case: its share of the step's loss), the gradients accumulating as a trainer's do.
    Returns (the step's loss, {name: gradient}, seconds)."""
    for p in trainable.values():
        p.grad = None
    start = time.perf_counter()
    loss = 0.0
    for part in [micro_case(case, rows) for rows in case.micro_batches] if case.micro_batches else [case]:
        part_loss = loss_fn(model, part)
        part_loss.backward()
        loss = loss + part_loss.detach()
    seconds = time.perf_counter() - start
    missing = [n for n, p in trainable.items() if p.grad is None]
    if missing:  # e.g. a tensor the loss does not reach: the protocol wants every trainable tensor
        raise CaseError(f"no gradient for {missing[:4]}")
    grads = {n: p.grad.detach().to(case.dtype).contiguous() for n, p in trainable.items()}
    return loss.item(), grads, seconds


def _replace_atomically(target, write):
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_outputs(case, loss, grads, seconds=None, micro_batches=None):
    """grads.safetensors first, then result.json: a result.json always has its gradients beside it. micro_batches:
    how many the step ran (a micro-batch case)."""
    _replace_atomically(case.dir / "grads.safetensors", lambda tmp: save_file(grads, tmp, metadata={"format": "pt"}))
    result = {"loss": loss} if seconds is None else {"loss": loss, "seconds": seconds}
    if micro_batches is not None:
        result["micro_batches"] = micro_batches
    _replace_atomically(case.dir / "result.json", lambda tmp: Path(tmp).write_text(json.dumps(result) + "\n"))


def main(argv, loss_fn, usage, accumulates=False):
    """The adapters' shared command line: [--gradient-checkpointing] CASE_DIR. Exit 0 with outputs written, 2 on a
    case this adapter cannot run (message on stderr), 3 on one it cannot express (NotExpressible). `accumulates`:
    loss_fn normalises a micro-batch by the step's totals (Case.union), so micro-batch cases run (run_step)."""
    args = [a for a in argv if a != "--gradient-checkpointing"]
    if len(args) != 1 or args[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    try:
        case = read_case(args[0], accumulates)
        if case.ranks != 1:
            raise NotExpressible(f"{case.ranks} ranks: this adapter runs one process")
        model, trainable = load_model(case, gradient_checkpointing=len(args) != len(argv))
        loss, grads, seconds = run_step(case, model, trainable, loss_fn)
    except CaseError as e:
        print(f"{Path(argv[-1]).name}: {e}", file=sys.stderr)
        return 2
    except NotExpressible as e:
        print(f"{Path(argv[-1]).name}: {e}", file=sys.stderr)
        return NOT_EXPRESSIBLE
    write_outputs(case, loss, grads, seconds, len(case.micro_batches) if case.micro_batches else None)
    return 0
