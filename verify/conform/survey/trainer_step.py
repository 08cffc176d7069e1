"""One optimizer step of a transformers Trainer (or a TRL trainer built on it) over a case's micro-batches, shared by
the survey's trainer adapters (hf_trainer.py, trl_dpo.py, trl_sft.py). The Trainer runs as its users run it; two
things are the adapter's, neither a normalisation:
  - the data loader yields the case's micro-batches (their sizes differ, which a fixed batch_size cannot say), through
    the Trainer's own accelerator.prepare;
  - the optimizer is a no-op whose step() copies the .grad it is handed (clipping off: max_grad_norm=0).
"""
import inspect
import tempfile
import time

import protocol
from protocol import CaseError, NotExpressible


def load_pinned_model(case):
    """The case's HF checkpoint under whichever transformers the entry pins (its dtype keyword, a model class it may
    lack: N/A), without the generation cache."""
    import transformers

    protocol.quiet_hf()
    try:
        config = transformers.AutoConfig.from_pretrained(case.dir / "model")
    except (KeyError, ValueError) as e:  # e.g. qwen3 before transformers 4.51
        raise NotExpressible(f"transformers {transformers.__version__} has no class for this model: {e}")
    kwarg = "dtype" if "dtype" in inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters \
        else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(case.dir / "model", config=config,
                                                              attn_implementation="sdpa", **{kwarg: case.dtype})
    model.config.use_cache = False
    return model


def step_arguments(output_dir, micro_batches):
    """TrainingArguments' fields for one optimizer step of `micro_batches` micro-batches in which nothing else moves
    (no clipping, no learning rate, no logging or saving), on the CPU."""
    return dict(output_dir=output_dir, gradient_accumulation_steps=micro_batches, max_steps=1, max_grad_norm=0.0,
                per_device_train_batch_size=1, learning_rate=0.0, lr_scheduler_type="constant", report_to=[],
                save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)


def trainer_step(trainer_class, make_args, model, params, micro, loader_rows=None, collate=None, **trainer_kwargs):
    """Runs trainer_class(model, args=make_args(output_dir), optimizers=..., **trainer_kwargs).train() for one step
    whose micro-batches are `micro` (lists of indices into `loader_rows`; None: the Trainer's own processed
    train_dataset), collated by `collate` (None: the Trainer's data_collator). `params`: {name: parameter} whose
    gradients the step must hand the optimizer. Returns (the Trainer's training_loss, {name: gradient}, seconds)."""
    import torch

    seen = {}

    class Capture(torch.optim.Optimizer):
        """The optimizer the Trainer hands its accumulated gradients to: it keeps them and changes nothing."""

        def __init__(self, parameters):
            super().__init__(parameters, {"lr": 0.0})

        def step(self, closure=None):
            seen.update({n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None})

    class StepTrainer(trainer_class):
        def get_train_dataloader(self):
            rows = self.train_dataset if loader_rows is None else loader_rows
            loader = torch.utils.data.DataLoader(rows, batch_sampler=micro, collate_fn=collate or self.data_collator)
            return self.accelerator.prepare(loader)

    optimizer = Capture(model.parameters())
    with tempfile.TemporaryDirectory() as out:
        trainer = StepTrainer(model=model, args=make_args(out),
                              optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)),
                              **trainer_kwargs)
        start = time.perf_counter()
        output = trainer.train()
        seconds = time.perf_counter() - start
    missing = [n for n in params if n not in seen]
    if missing:
        raise CaseError(f"the Trainer's optimizer step saw no gradient for {missing[:4]}")
    return float(output.training_loss), seen, seconds


def main(argv, run, usage, packs=False):
    """A trainer adapter's command line on the package's protocol.run: run(case) -> (loss, {name: gradient}, seconds,
    the micro-batches the Trainer stepped over), checked by the harness against the case's. `packs`: the adapter
    runs packed cases (protocol.run's declaration; others report them N/A)."""
    def step(case):
        loss, grads, seconds, steps = run(case)
        return protocol.Result(loss, grads, seconds, steps if case.micro_batches else None)

    return protocol.run(step, argv, accumulates=True, usage=usage, packs=packs)
