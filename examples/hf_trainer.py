"""ZenFlowAdamW under the Hugging Face Trainer: a small GPT-2 built from a config, synthetic tokens.

    pip install transformers accelerate       # or: pip install -e ".[integrations]"
    python examples/hf_trainer.py             # about 10 seconds on CPU
    python examples/hf_trainer.py --steps 8   # shorter (the test suite runs it like this)

ZenFlowCallback gives the model the flushed weights for every checkpoint and evaluation (so checkpoint-N
holds current weights, not ones an interval stale) and the weights training continues from afterwards (so
saving and evaluating do not change the run), closes the optimizer at the end, and hands it the epoch
length in optimizer steps. GPT-2's projections are ``Conv1D`` layers that store their weight as ``[in, out]``:
for them a ZenFlow "column" is an output feature, not an input channel as for ``nn.Linear``.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
import transformers

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.integrations.transformers import ZenFlowCallback


class Tokens(torch.utils.data.Dataset):
    """Repeating token patterns a tiny model can learn."""

    def __init__(self, n: int, length: int = 32, vocab: int = 128, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.x = (starts + torch.arange(length) * 3) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    out = tempfile.mkdtemp()
    training = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=args.steps,
        eval_strategy="steps", eval_steps=max(1, args.steps // 2), save_steps=max(1, args.steps // 2),
        logging_steps=max(1, args.steps // 4), report_to=[], seed=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=training, train_dataset=Tokens(256), eval_dataset=Tokens(32, seed=1),
        # the Trainer builds the optimizer with its weight-decay groups; ZenFlowCallback gives it the epoch length
        optimizer_cls_and_kwargs=(ZenFlowAdamW, dict(lr=3e-3, zenflow=dict(topk_ratio=0.1, update_interval=4,
                                                                           overlap_step=True))),
        callbacks=[ZenFlowCallback()],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*never re-selected.*")  # the callback gives the epoch length
        trainer.train()
    metrics = trainer.evaluate()
    opt = trainer.optimizer.optimizer  # accelerate wraps it
    print(f"eval loss {metrics['eval_loss']:.3f} after {args.steps} steps; epoch length given to ZenFlow: "
          f"{opt.schedule.steps_per_epoch} optimizer steps; checkpoints in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
