"""hf.py — forge.optim in Hugging Face transformers' Trainer.

    from forge.integrations.hf import trainer_optimizer
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(trainer_optimizer(model, args), None))

trainer_optimizer builds the forge optimizer the way Trainer builds its own AdamW from the
TrainingArguments: learning_rate, adam_beta1/adam_beta2, adam_epsilon, and weight_decay on
the parameters Trainer decays (not biases or norms). Trainer then creates the LR schedule
for it, and its loop works unchanged: max_grad_norm clips through
torch.nn.utils.clip_grad_norm_ and logs the pre-clip grad_norm, gradient_accumulation_steps
accumulates micro-batches, fp16 runs GradScaler, bf16 autocast. That loop uses the gradient
before opt.step(), so the optimizer (mode "auto") stays deferred: exact, and without a
gradient where a Linear's X and dY are smaller than its dW.
"""
from __future__ import annotations

from typing import Any


def trainer_optimizer(model, args, optimizer: str = "AdamW", **forge_options: Any):
    """forge.optim.<optimizer> over `model` with the hyper-parameters of TrainingArguments
    `args` (see the file header); forge_options go to the constructor (state_format, ...)."""
    import forge.optim
    try:
        from transformers import Trainer
        decayed = set(Trainer.get_decay_parameter_names(None, model))
    except (ImportError, AttributeError, TypeError):
        decayed = None
    if decayed is None:
        params = forge.optim.param_groups_no_decay(model, args.weight_decay)
    else:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [{"params": [p for n, p in named if n in decayed],
                   "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]
        params = [g for g in params if g["params"]]
    cls = getattr(forge.optim, optimizer)
    kwargs = dict(lr=args.learning_rate)
    if optimizer in ("AdamW", "Adam", "NAdam", "RAdam"):
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    return cls(model, params=params, **kwargs, **forge_options)
