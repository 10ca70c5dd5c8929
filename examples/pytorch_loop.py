"""PyTorch under `slurmagent run -- python examples/pytorch_loop.py [TOTAL]` (needs torch installed).

The checkpoint is saved to a temporary name and renamed, so the background sync never
uploads a half-written file and a restore always sees a whole one.
"""

import os
import sys

import torch

from slurmagent import trainer

TOTAL = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000

# recipe: loop
model = torch.nn.Linear(128, 10)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = trainer.ckpt_dir() / "model.pt"
step = 0
if trainer.resumed() and ckpt.exists():
    state = torch.load(ckpt, map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]


def save() -> None:
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, ckpt)
    trainer.saved(ckpt, step=step)  # whole: the next sync round commits it


with trainer.checkpoint_handler():
    while step < TOTAL:
        loss = model(torch.randn(32, 128)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 500 == 0 or trainer.checkpoint_requested():
            save()
        if trainer.checkpoint_requested():
            sys.exit(0)
# recipe: end
