"""The file protocol "streambp-conform/1" (docs/conformance.md), adapter side: read a case directory into a typed
Case, run the user's function on it, write what it returns, and exit with the status the harness reads.

  model/ (HF checkpoint), adapter/ (PEFT, LoRA cases), batch.safetensors, case.json   <- written by the harness
  grads.safetensors (every trainable tensor, HF/PEFT saved names, the case dtype), result.json   <- written here
"""
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

from streambp_conform import warm

PROTOCOL = "streambp-conform/1"
NOT_EXPRESSIBLE = 3  # the harness reports the case N/A, neither passed nor failed
BAD_CASE = 2
DTYPE_NAMES = ("float64", "float32", "bfloat16")
OBJECTIVE_NAMES = ("sft", "grpo", "dpo")
PACKED_OBJECTIVES = ("sft", "grpo")  # DPO has no packed layout (its pairs would be matched across packs)


class CaseError(Exception):
    """A malformed case, or one this adapter cannot run: exit 2, the message naming the case."""


class NotExpressible(Exception):
    """A well-formed case the wrapped library cannot express (a model family, a loss, a distributed layout it does not
    have): exit 3 with the reason as the last line; the harness reports the case N/A."""


@dataclass(frozen=True)
class Objective:
    """case.json's objective: `name` (sft, grpo, dpo) and TRL's option names and values (GRPO beta, epsilon, loss_type,
    importance_sampling_level, temperature, ...; DPO beta, label_smoothing, loss_type). Reads like the dict it was
    (objective["beta"], objective.get("epsilon", 0.2)), so losses written against case.json keep working."""
    name: str
    options: dict = field(default_factory=dict)

    def get(self, key, default=None):
        return self.name if key == "name" else self.options.get(key, default)

    def __getitem__(self, key):
        if key == "name":
            return self.name
        return self.options[key]


@dataclass(frozen=True)
class Chunks:
    """The suggested tile sizes along the sequence (a chunked implementation's; a plain one ignores them)."""
    layer: int
    head: int


@dataclass
class Case:
    dir: Path
    name: str
    dtype: "torch.dtype"  # noqa: F821  (float64, float32 or bfloat16: the model's, the gradients')
    objective: Objective
    lora: bool            # True: only the PEFT adapter in adapter/ trains
    head_chunk: int       # the suggested sequence chunk of the LM head
    batch: dict           # tensor name -> tensor [B, T], as in batch.safetensors (input_ids, attention_mask, labels, ...)
    layer_chunk: int = 0  # the suggested chunk (tile) of a layer's sequence
    ranks: int = 1        # processes a distributed implementation runs itself (1: one)
    parallel: str = "data"  # how the ranks split the work: "data" (rows) or "sequence" (positions)
    micro_batches: list = None  # the optimizer step's micro-batches, each a list of batch rows; None: one pass
    union: dict = None    # on one micro-batch's Case (micro_case): the whole step's batch, whose totals normalise
    # Packed rows (case.json "packed"): several sequences a row, each attending causally within itself only. The
    # boundaries in both forms: position_ids [B, T] (also batch["position_ids"]: 0 at each sequence's first token,
    # as DataCollatorWithFlattening writes them) and cu_seqlens [n + 1] int32 (flash-attention's varlen form: the
    # cumulative segment lengths over the B*T tokens flattened row after row; a ragged row's padding is a segment of
    # its own). sequences: each row's sequence lengths, the padding not among them; max_length: the longest segment.
    packed: bool = False
    position_ids: "torch.Tensor" = None  # noqa: F821
    cu_seqlens: "torch.Tensor" = None  # noqa: F821
    sequences: list = None
    max_length: int = None
    # A packed GRPO case (verl's remove-padding layout, docs/packing.md): each packed sequence one completion, and the
    # batch tensors named here (case.json "per_sequence": advantages) hold one value per sequence in cu_seqlens order,
    # [n], where a padded case holds one per row. sequence_ids gives each position's sequence.
    per_sequence: tuple = ()
    # A whole RL step (case.json kind "rl_step", docs/rl-steps.md): the generation batch as a streambp_conform.rl.RlCase
    # (prompts, raw completions, rewards, TRL's settings, the micro-batch layout); `batch` is then empty and the model
    # the policy at generation time. The step returns every optimizer step's gradient as "step{k}/<HF name>"
    # (rl.returned_tensors), optionally with the trainer's advantages, completion_mask and token_logps.
    rl: "rl.RlCase" = None  # noqa: F821

    @property
    def model_dir(self):
        """An HF checkpoint in the case dtype: transformers.AutoModelForCausalLM.from_pretrained(case.model_dir)."""
        return self.dir / "model"

    @property
    def adapter_dir(self):
        """The PEFT adapter folder of a LoRA case (None otherwise)."""
        return self.dir / "adapter" if self.lora else None

    @property
    def config(self):
        """model/config.json as a dict (model_type qwen3, qwen2 or llama)."""
        return json.loads((self.model_dir / "config.json").read_text())

    @property
    def chunks(self):
        return Chunks(self.layer_chunk, self.head_chunk)

    @property
    def sequence_ids(self):
        """A packed case's [B, T] int64: each position's segment of cu_seqlens (its sequence's index in the
        per-sequence tensors, counted over the batch row after row; a ragged row's padding is a segment too)."""
        if not self.packed:
            raise CaseError("sequence_ids: not a packed case")
        return segment_ids(self.position_ids)


@dataclass
class Result:
    """What a step returns when more than (loss, gradients) is to be said: its own timing, or how many micro-batches
    it ran (the harness checks that against the case's)."""
    loss: float
    grads: dict
    seconds: float = None
    micro_batches: int = None


def packed_objectives(packs):
    """run()'s and read_case()'s `packs` as the set of objectives whose packed rows the caller runs. True means SFT's:
    the only packed rows the protocol had when adapters first declared it, so an adapter written then is never handed
    packed GRPO rows it would read per row; packed GRPO is declared by name, packs=("sft", "grpo"). False or None:
    none. A name that has no packed layout (dpo) or is no objective is the caller's mistake: ValueError."""
    if packs is None or packs is False:
        return set()
    if packs is True:
        return {"sft"}
    names = {str(o).lower() for o in ([packs] if isinstance(packs, str) else packs)}
    wrong = sorted(names - set(PACKED_OBJECTIVES))
    if wrong:
        raise ValueError(f"packs {sorted(names)}: {', '.join(wrong)} has no packed layout (packed rows are "
                         f"{' and '.join(o.upper() for o in PACKED_OBJECTIVES)}'s)")
    return names


def segment_ids(position_ids):
    """[B, T] int64: each token's segment (a run of position_ids from 0) over the batch, row after row, from 0."""
    import torch

    return (position_ids.reshape(-1) == 0).cumsum(0).sub(1).reshape(position_ids.shape).to(torch.long)


def _dtypes():
    import torch

    return {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _meta(case_dir):
    try:
        meta = json.loads((case_dir / "case.json").read_text())
    except (OSError, ValueError) as e:
        raise CaseError(f"case.json: {e}")
    if meta.get("protocol") != PROTOCOL:
        raise CaseError(f"case.json: protocol {meta.get('protocol')!r}, this adapter speaks {PROTOCOL!r}")
    if meta.get("dtype") not in DTYPE_NAMES:
        raise CaseError(f"case.json: dtype {meta.get('dtype')!r} (one of {', '.join(DTYPE_NAMES)})")
    objective = meta.get("objective") or {}
    if objective.get("name") not in OBJECTIVE_NAMES:
        raise CaseError(f"case.json: objective {objective!r} (name sft, grpo or dpo)")
    if meta.get("parallel", "data") not in ("data", "sequence"):
        raise CaseError(f"case.json: parallel {meta.get('parallel')!r} (data or sequence)")
    return meta


def objective_names(objectives):
    """`objectives` as a set of lower-case names (None: any). A name that is no objective is the caller's mistake, not
    a case to decline: "SFT" once made every case N/A, and a run that judged nothing looked green."""
    if objectives is None:
        return None
    names = {str(o).lower() for o in ([objectives] if isinstance(objectives, str) else objectives)}
    unknown = sorted(names - set(OBJECTIVE_NAMES))
    if unknown or not names:
        raise ValueError(f"objectives {sorted(names)}: {'unknown ' + ', '.join(unknown) if unknown else 'none'} "
                         f"(valid: {', '.join(OBJECTIVE_NAMES)}; None: any)")
    return names


def cu_seqlens_from_position_ids(position_ids):
    """[n + 1] int32: where each segment starts (a position 0) over the B*T tokens flattened row after row, then B*T."""
    import torch

    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    return torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)


def position_ids_from_cu_seqlens(cu_seqlens, rows, seq_len):
    """[rows, seq_len] int64: each token's place in its segment (cu_seqlens over the flattened rows)."""
    import torch

    cu = cu_seqlens.to(torch.long)
    index = torch.arange(rows * seq_len)
    start = cu[torch.searchsorted(cu, index, right=True) - 1]
    return (index - start).reshape(rows, seq_len)


def _sequences_of(position_ids, attention_mask):
    """Each row's sequence lengths (segments of position_ids), the padding segment (attention_mask 0) left out."""
    out = []
    for pos, mask in zip(position_ids.tolist(), attention_mask.tolist()):
        starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
        out.append([e - s for s, e in zip(starts, starts[1:]) if mask[s]])
    return out


def _packed_fields(batch, meta, case_dir):
    """The packed keys of a Case from batch.safetensors and case.json: both boundary forms (the one derived from the
    other when the file has one), checked to agree; cu_seqlens is taken out of the batch (it is not per row)."""
    import torch

    B, T = batch["input_ids"].shape
    pos, cu = batch.get("position_ids"), batch.pop("cu_seqlens", None)
    if pos is None and cu is None:
        raise CaseError("batch.safetensors: a packed case (case.json packed) has neither position_ids nor cu_seqlens")
    if pos is None:
        pos = position_ids_from_cu_seqlens(cu, B, T)
        batch["position_ids"] = pos
    derived = cu_seqlens_from_position_ids(pos)
    if cu is not None and not torch.equal(cu.to(torch.long), derived.to(torch.long)):
        raise CaseError("batch.safetensors: cu_seqlens and position_ids describe different sequences")
    sequences = meta.get("sequences") or _sequences_of(pos, batch["attention_mask"])
    lengths = derived[1:] - derived[:-1]
    per_sequence = tuple(meta.get("per_sequence") or ())
    for name in per_sequence:  # one value per segment of cu_seqlens
        if name not in batch or tuple(batch[name].shape) != (lengths.numel(),):
            shape = tuple(batch[name].shape) if name in batch else "missing"
            raise CaseError(f"batch.safetensors: {name!r} is per packed sequence (case.json per_sequence): shape "
                            f"{shape}, expected ({lengths.numel()},)")
    return dict(packed=True, position_ids=pos, cu_seqlens=derived, sequences=sequences,
                max_length=int(meta.get("max_length") or lengths.max()), per_sequence=per_sequence)


def _rl_step_case(case_dir, meta):
    """An rl_step case: its generation batch (case.json "rl_step") and the fp64 policy in model/."""
    from streambp_conform import rl

    try:
        step = rl.RlCase.from_json(meta["rl_step"])
    except (KeyError, TypeError) as e:
        raise CaseError(f"case.json: kind rl_step without a well-formed \"rl_step\" ({e})")
    objective = dict(meta["objective"])
    return Case(case_dir, meta.get("case", case_dir.name), _dtypes()[meta["dtype"]],
                Objective(objective.pop("name"), objective), False, 0, {}, rl=step)


def declines_rl_step(case_dir):
    """For an adapter that reads case.json itself before any torch or torchrun (which reports a rank's exit 3 as 1):
    NOT_EXPRESSIBLE, with the reason printed naming the case, when the case is a whole RL step (kind rl_step, conform
    --cases rl or rl-verl) it does not run; None otherwise (a case.json it cannot read is left to its own reading)."""
    case_dir = Path(case_dir)
    try:
        kind = json.loads((case_dir / "case.json").read_text()).get("kind", "batch")
    except (OSError, ValueError, AttributeError):
        return None
    if kind != "rl_step":
        return None
    print(f"{case_dir.name}: a whole RL step (kind rl_step: generations, rewards and a trainer's settings): this "
          "adapter runs a loss on a batch, not a trainer's RL step", file=sys.stderr)
    return NOT_EXPRESSIBLE


def read_case(case_dir, accumulates=False, distributed=True, objectives=None, packs=True, rl_steps=False):
    """The case. Declined (NotExpressible) before torch loads: a micro-batch case unless the caller `accumulates` (runs
    the step's micro-batches into one gradient normalised by the step's totals), a case of several ranks unless it is
    `distributed`, an objective not in `objectives` (names, any case; None: any; ValueError for an unknown one), a
    packed case unless it `packs` that objective's packed rows (attends within each sequence: Case.position_ids,
    cu_seqlens; True: SFT's; packed GRPO's per-sequence advantages need packs=("sft", "grpo"): packed_objectives), a
    whole RL step (kind rl_step: Case.rl) unless the caller runs `rl_steps`, and (when it does) every case of another
    kind."""
    objectives = objective_names(objectives)
    packs = packed_objectives(packs)
    case_dir = Path(case_dir)
    meta = _meta(case_dir)
    kind = meta.get("kind", "batch")  # absent in files written before the protocol had kinds: a batch
    if kind not in ("batch", "rl_step"):
        raise CaseError(f"case.json: kind {kind!r} (batch or rl_step)")
    if (kind == "rl_step") != bool(rl_steps):
        raise NotExpressible(
            "a whole RL step (kind rl_step: generations, rewards and a trainer's settings): this adapter does not "
            "declare RL steps: run(..., rl_steps=True)" if kind == "rl_step" else
            "a loss on a batch (kind batch): this adapter runs whole RL steps (kind rl_step) only")
    if kind == "rl_step":
        return _rl_step_case(case_dir, meta)
    if objectives is not None and meta["objective"]["name"] not in objectives:
        raise NotExpressible(f"objective {meta['objective']['name']}: this adapter implements "
                             f"{' and '.join(sorted(o.upper() for o in objectives))} only")
    if meta.get("packed") and meta["objective"]["name"] not in packs:
        rows = meta.get("sequences") or []
        where = f"{sum(len(r) for r in rows)} sequences in {len(rows)} rows"
        if meta["objective"]["name"] != "grpo":
            raise NotExpressible(f"packed rows ({where}): this adapter does not declare packed rows: "
                                 "run(..., packs=True)")
        raise NotExpressible(f"packed GRPO rows ({where}, one completion and advantage each): this adapter does not "
                             "declare packed GRPO rows: run(..., packs=(\"sft\", \"grpo\"))")
    micro = meta.get("micro_batches")
    if micro is not None and not accumulates:
        raise NotExpressible(f"{len(micro)} micro-batches: this adapter runs one batch per optimizer step")
    ranks = int(meta.get("ranks", 1))  # absent in files written before the protocol had ranks: one process
    if ranks != 1 and not distributed:
        raise NotExpressible(f"{ranks} ranks: this adapter runs one process")
    from safetensors.torch import load_file

    batch = load_file(str(case_dir / "batch.safetensors"))
    for key in ("input_ids", "attention_mask"):
        if key not in batch:
            raise CaseError(f"batch.safetensors: no tensor {key!r}")
    chunks = meta.get("chunks") or {}
    T = batch["input_ids"].size(1)
    objective = dict(meta["objective"])
    packed = _packed_fields(batch, meta, case_dir) if meta.get("packed") else {}
    return Case(case_dir, meta.get("case", case_dir.name), _dtypes()[meta["dtype"]],
                Objective(objective.pop("name"), objective), bool(meta.get("lora")), int(chunks.get("head") or T),
                batch, int(chunks.get("layer") or T), ranks, parallel=meta.get("parallel", "data"),
                micro_batches=micro, **packed)


def micro_case(case, rows):
    """The Case of one micro-batch: its rows of every batch tensor, and the whole step's batch as `union`; a packed
    case's boundaries those of its rows, and its per-sequence tensors (advantages) those of the rows' sequences."""
    import torch

    index = torch.tensor(rows, dtype=torch.long)
    part = replace(case, batch={k: v.index_select(0, index) for k, v in case.batch.items() if k not in case.per_sequence},
                   union=case.batch)
    if case.per_sequence:  # each row's sequences are a run of segments: row r's start at the row's first segment
        first = torch.cat([torch.zeros(1, dtype=torch.long), (case.position_ids == 0).sum(1).cumsum(0)])
        sequences = torch.cat([torch.arange(int(first[r]), int(first[r + 1])) for r in rows])
        part.batch.update({k: case.batch[k].index_select(0, sequences) for k in case.per_sequence})
    if case.packed:
        part.position_ids = part.batch["position_ids"]
        part.cu_seqlens = cu_seqlens_from_position_ids(part.position_ids)
        part.sequences = [case.sequences[r] for r in rows]
        part.max_length = int((part.cu_seqlens[1:] - part.cu_seqlens[:-1]).max())
    return part


def saved_peft_name(name):
    """named_parameters() carries PEFT's adapter name ("lora_A.default.weight"); its saved files, and the harness, do
    not ("lora_A.weight")."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def _grads_to_save(case, grads):
    """{saved name: contiguous gradient in the case dtype}; a name given twice (with and without PEFT's adapter name)
    or a value that is not a tensor is the adapter's bug, named."""
    import torch

    out = {}
    for name, g in grads.items():
        saved = saved_peft_name(name)
        if saved in out:
            raise CaseError(f"gradient {saved!r} returned twice")
        if not isinstance(g, torch.Tensor):
            raise CaseError(f"gradient {name!r} is {type(g).__name__}, not a tensor (a parameter without .grad?)")
        out[saved] = g.detach().to(case.dtype).contiguous()
    return out


def _cpu_seconds():
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


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
    """grads.safetensors first, then result.json, each atomically: a result.json always has its gradients beside it.
    micro_batches: how many the step ran (a micro-batch case). result.json also says which python and torch computed
    them (conform's provenance: a user's venv is not the harness's)."""
    import torch
    from safetensors.torch import save_file

    grads = _grads_to_save(case, grads)
    _replace_atomically(case.dir / "grads.safetensors", lambda tmp: save_file(grads, tmp, metadata={"format": "pt"}))
    result = {"loss": float(loss)} if seconds is None else {"loss": float(loss), "seconds": seconds}
    result.update(python=sys.executable, torch_version=torch.__version__)
    if micro_batches is not None:
        result["micro_batches"] = micro_batches
    if warm.in_worker():  # conform measures the process it started, which is not this one's parent
        result["cpu_seconds"] = _cpu_seconds()
    _replace_atomically(case.dir / "result.json", lambda tmp: Path(tmp).write_text(json.dumps(result) + "\n"))


def run(step, argv=None, accumulates=False, distributed=False, objectives=None, usage=None, packs=False,
        rl_steps=False):
    """The adapter's command line, CASE_DIR: read the case, call step(case) -> (loss, {name: gradient}) or a Result,
    write the outputs; returns the exit status (0 written; 2 a bad case or usage; 3 NotExpressible; 1 any other
    exception, its traceback and then one line naming the case). `accumulates`: step runs a micro-batch case's
    micro-batches (micro_case) as its trainer does; `distributed`: step runs case.ranks processes itself; `packs`:
    step keeps each packed sequence to itself (position_ids or cu_seqlens; streambp_conform.hf.model_inputs), where
    an adapter that never heard of packing would attend across them: True for SFT's packed rows, ("sft", "grpo")
    also for packed GRPO's, whose per-sequence tensors (Case.per_sequence: advantages) the step reads by
    Case.sequence_ids; `rl_steps`: step runs a trainer on a whole RL
    step (Case.rl) and returns its optimizer steps' gradients (streambp_conform.rl.returned_tensors), and declines
    every other case. Otherwise
    such cases are declined before torch loads, as are objectives not in `objectives` (sft, grpo, dpo in any case;
    None: any; an unknown name exits 2 on every case). Gradients may carry PEFT's in-memory names; they are saved as
    PEFT's files name them, in the case dtype."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(usage or f"Usage: {Path(sys.argv[0]).name} CASE_DIR", file=sys.stderr)
        return BAD_CASE
    try:
        objectives = objective_names(objectives)
    except ValueError as e:  # the adapter's own mistake: every case fails with it, none is quietly N/A
        print(f"{Path(sys.argv[0]).name}: run(objectives=...): {e}", file=sys.stderr)
        return BAD_CASE
    try:
        packed_objectives(packs)
    except ValueError as e:
        print(f"{Path(sys.argv[0]).name}: run(packs=...): {e}", file=sys.stderr)
        return BAD_CASE
    name = Path(argv[0]).name
    try:
        case = read_case(argv[0], accumulates, distributed, objectives, packs, rl_steps)
        name = case.name
        start = time.perf_counter()
        out = step(case)
        seconds = time.perf_counter() - start
        result = out if isinstance(out, Result) else Result(*out)
        if result.micro_batches is None and case.micro_batches:
            result.micro_batches = len(case.micro_batches)
        write_outputs(case, result.loss, result.grads, seconds if result.seconds is None else result.seconds,
                      result.micro_batches)
    except CaseError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return BAD_CASE
    except NotExpressible as e:
        print(f"{name}: {e}", file=sys.stderr)
        return NOT_EXPRESSIBLE
    except Exception as e:  # noqa: BLE001  the harness shows the last line: make it name the case
        traceback.print_exc()
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
