"""The sample project's conformance adapter: one function on streambp_conform (pip install ./verify/conform).
Usage: adapter.py [--wrong] CASE_DIR   (--wrong: the chunk-means loss, which conform must reject)"""
import sys
from pathlib import Path

from streambp_conform.warm import delegate

delegate()  # under pytest --streambp-warm: run in a worker whose imports are done (docs/conform-in-ci.md)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from streambp_conform import Case, NotExpressible, run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_loss import chunked_cross_entropy, chunked_cross_entropy_wrong  # noqa: E402

LOSS = chunked_cross_entropy_wrong if "--wrong" in sys.argv else chunked_cross_entropy


def rms_norm(self, x):  # HF's RMSNorm computes in exactly fp32; in at least fp32, an fp64 case stays fp64
    xc = x.to(torch.promote_types(x.dtype, torch.float32))
    return self.weight * (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


def gradients(case: Case):
    if case.lora:
        raise NotExpressible("LoRA: this project trains full weights only")
    import transformers
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    modeling_qwen3.Qwen3RMSNorm.forward = modeling_qwen2.Qwen2RMSNorm.forward = rms_norm
    model = transformers.AutoModelForCausalLM.from_pretrained(case.model_dir, dtype=case.dtype)
    b = case.batch
    hidden = model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state  # [B, T, d]
    targets = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # position t predicts token t + 1
    loss = LOSS(hidden, model.lm_head.weight, targets, case.head_chunk)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


if __name__ == "__main__":
    sys.exit(run(gradients, [a for a in sys.argv[1:] if a != "--wrong"], objectives={"sft"}))
