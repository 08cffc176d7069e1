from streambp_conform.warm import delegate

delegate()  # first: under pytest --streambp-warm the case runs in a worker whose imports are done
import sys

import my_library  # your library
from streambp_conform import Case, NotExpressible, run
from streambp_conform.hf import fp64_exact

fp64_exact()  # HF's RMSNorms compute in fp32 even in an fp64 model; the fp64 cases' bar is 1e-10


def gradients(case: Case):
    if case.lora:  # anything your library does not have: the case is N/A (skipped)
        raise NotExpressible("LoRA: full fine-tuning only")
    model = my_library.load(case.model_dir, dtype=case.dtype)  # an HF checkpoint in the case dtype
    loss = my_library.loss(model, case.batch, chunk=case.head_chunk)  # batch: input_ids, attention_mask, labels
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


if __name__ == "__main__":
    sys.exit(run(gradients, objectives={"sft"}))
