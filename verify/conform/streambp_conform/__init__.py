"""streambp-conform: write a conformance adapter as one function (issue #47).

    from streambp_conform import Case, NotExpressible, run

    def gradients(case: Case):
        if case.objective.name != "sft":
            raise NotExpressible("SFT only")
        ...  # the user's model and loss on case.model_dir and case.batch, in case.dtype
        return loss, {name: p.grad for name, p in model.named_parameters()}

    if __name__ == "__main__":
        run(gradients)

The package reads the case directory, writes grads.safetensors (HF names, the case dtype) and result.json
atomically, and turns the outcome into the exit status `streambp conform` reads (0, 2 bad case, 3 not
expressible). The pytest plugin (streambp_conform.pytest_plugin) runs the harness from pytest;
streambp_conform.hf.fp64_exact() keeps HF's RMSNorms in fp64 for the fp64 cases; streambp_conform.warm starts
adapters warm; streambp_conform.rl replaces a GRPO trainer's generation and reward models by an RL step case's values
and reads the gradient at the optimizer step (docs/rl-steps.md).
"""
from streambp_conform.protocol import (NOT_EXPRESSIBLE, PROTOCOL, Case, CaseError, Chunks, NotExpressible, Objective,
                                       Result, micro_case, read_case, run, saved_peft_name, write_outputs)

__all__ = ["NOT_EXPRESSIBLE", "PROTOCOL", "Case", "CaseError", "Chunks", "NotExpressible", "Objective", "Result",
           "micro_case", "read_case", "run", "saved_peft_name", "write_outputs"]
