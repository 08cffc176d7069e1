"""What the GPU-only survey adapters (liger_adapter.py, cce_adapter.py, unsloth_adapter.py) share: the device choice,
one timed step on that device, and the command line. The protocol itself (reading a case, loading the HF/PEFT model
under the names grads.safetensors must use, atomic writes) is the harness's protocol.py, imported from the work tree
as hf_adapter.py imports it.

Device: CUDA when torch sees one. Without one, an adapter exits 2 at once with "CASE: needs a GPU: <reason>"
(a protocol.CaseError, which the harness reports as "cannot run"), unless the library's kernels are Triton programs
and TRITON_INTERPRET=1 is set: then they run on CPU in Triton's numpy interpreter (triton_interp_shim.py closes two
gaps of it), slowly but with the kernels' own algorithm (chunking, filtering, fp32 accumulation)."""
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFORM = Path(__file__).resolve().parents[1]  # verify/conform: protocol.py, losses.py
sys.path.insert(0, str(CONFORM))
sys.path.insert(0, str(HERE))
import protocol  # noqa: E402
from protocol import CaseError  # noqa: E402

# exit 3, "not expressible" (neither passed nor failed): a case the library itself has no way to run (a dtype its
# kernels lack, several ranks).
NotExpressible = protocol.NotExpressible
NOT_EXPRESSIBLE = protocol.NOT_EXPRESSIBLE

import torch  # noqa: E402


def no_gpu_reason():
    """Why torch has no CUDA device here, in a few words; None when it has one."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"no CUDA device (torch.cuda.is_available() is False; torch {torch.__version__})"


def pick_device(library, triton_interpretable):
    """'cuda', or 'cpu' under TRITON_INTERPRET=1 for a Triton library; otherwise CaseError("needs a GPU: ...")."""
    reason = no_gpu_reason()
    if reason is None:
        return "cuda"
    if triton_interpretable and os.environ.get("TRITON_INTERPRET") == "1":
        import triton_interp_shim

        triton_interp_shim.install()
        return "cpu"
    hint = "; TRITON_INTERPRET=1 runs its Triton kernels in Triton's CPU interpreter" if triton_interpretable else ""
    raise CaseError(f"needs a GPU: {reason}; {library}{hint}")


def to_device(case, model, device):
    """The model (same Parameter objects, so the trainable map stays valid) and the batch onto the device."""
    model.to(device)
    case.batch = {k: v.to(device) for k, v in case.batch.items()}


def run_step(case, model, trainable, loss_fn, device):
    """protocol.run_step on a device: forward + backward timed (synchronised), gradients back on CPU in the case dtype.
    A micro-batch case (an adapter that accumulates): one forward + backward per micro-batch, loss_fn getting
    protocol.micro_case's Case, whose `union` holds the step's totals."""
    for p in trainable.values():
        p.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = 0.0
    for part in [protocol.micro_case(case, rows) for rows in case.micro_batches] if case.micro_batches else [case]:
        part_loss = loss_fn(model, part)
        part_loss.backward()
        loss = loss + part_loss.detach()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    missing = [n for n, p in trainable.items() if p.grad is None]
    if missing:
        raise CaseError(f"no gradient for {missing[:4]}")
    grads = {n: p.grad.detach().to("cpu", case.dtype).contiguous() for n, p in trainable.items()}
    return float(loss.item()), grads, seconds


def shifted_targets(labels):
    """HF's causal-LM shift: position t predicts token t + 1; the last position has no target (-100)."""
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]


def split_flags(argv, known):
    """(flags from `known` that were given, the other arguments)."""
    return [a for a in argv if a in known], [a for a in argv if a not in known]


def main(argv, usage, flags, device_fn, prepare, loss_fn, load=None, declares=None):
    """[--gradient-checkpointing] [FLAGS] CASE_DIR. device_fn() -> device (or CaseError, before anything loads);
    prepare(case, model, flags) -> model after protocol.load_model (library patches); loss_fn(model, case, flags)
    -> scalar. A library with a loader of its own passes load(case, flags) -> (model, trainable) instead.
    declares(flags) -> protocol.read_case's declarations for this setting ({"accumulates": True, "packs": True}: the
    loss normalises a micro-batch by Case.union's totals, it runs packed rows); None: neither."""
    given, args = split_flags(argv, set(flags) | {"--gradient-checkpointing"})
    if len(args) != 1 or args[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    try:
        device = device_fn()
        declared = {"accumulates": False, "packs": False, **(declares(given) if declares else {})}
        case = protocol.read_case(args[0], **declared)
        if getattr(case, "ranks", 1) != 1:
            raise NotExpressible(f"{case.ranks} ranks: this adapter runs one process")
        if case.objective["name"] != "sft":
            raise CaseError(f"objective {case.objective['name']!r}: this adapter runs SFT only")
        if "labels" not in case.batch:
            raise CaseError("sft: batch.safetensors has no 'labels'")
        if load is not None:
            model, trainable = load(case, given)
        else:
            model, trainable = protocol.load_model(case, gradient_checkpointing="--gradient-checkpointing" in given)
            model = prepare(case, model, given) or model
        to_device(case, model, device)
        loss, grads, seconds = run_step(case, model, trainable, lambda m, c: loss_fn(m, c, given), device)
    except NotExpressible as e:  # before CaseError: without protocol.NotExpressible they are one class
        print(f"{Path(args[0]).name}: {e}", file=sys.stderr)
        return NOT_EXPRESSIBLE
    except CaseError as e:
        print(f"{Path(args[0]).name}: {e}", file=sys.stderr)
        return 2
    # a micro-batch case: how many run_step ran, which the harness checks against the case's
    protocol.write_outputs(case, loss, grads, seconds, len(case.micro_batches) if case.micro_batches else None)
    return 0
