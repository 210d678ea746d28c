"""The target stays frozen through a real Lightning fit: eval mode, no grads, bit-identical weights."""

import lightning as L
import torch
from torch import nn

LAYER_IDS = [1, 3]


class _DummyDraft(L.LightningModule):
    """A one-layer stand-in draft: taps -> hidden -> the target's frozen LM head; each step also encodes
    audio (the perception's BatchNorm would update its statistics in training mode). Its optimizer takes
    every parameter of the module, the target's included, as a careless draft would: only the target's
    own freezing keeps it unchanged."""

    def __init__(self, target, audio):
        super().__init__()
        self.target = target
        self.audio = audio
        self.proj = nn.Linear(len(LAYER_IDS) * target.hidden_size, target.hidden_size)
        self.target_training_flags: list[bool] = []

    def training_step(self, batch, _):
        ids = batch[0]
        self.target_training_flags.append(self.target.training or any(m.training for m in self.target.modules()))
        self.target.encode_audio(*self.audio)
        taps = self.target.forward_taps(self.target.embed_tokens(ids), None, LAYER_IDS).features
        logits = self.target.lm_head(self.proj(taps))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_target_unchanged_after_lightning_fit(tiny_target, speech_batch, tmp_path):
    before = {k: v.clone() for k, v in tiny_target.state_dict().items()}
    module = _DummyDraft(tiny_target, speech_batch)
    proj_before = module.proj.weight.detach().clone()
    data = torch.utils.data.TensorDataset(torch.randint(0, 300, (8, 16), generator=torch.Generator().manual_seed(0)))
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))

    assert trainer.global_step == 4
    assert module.target_training_flags == [False] * 4, "a target module left eval mode during fit"
    assert not any(p.requires_grad for p in tiny_target.parameters())
    assert all(p.grad is None for p in tiny_target.parameters()), "a target parameter received a gradient"
    assert not torch.equal(module.proj.weight.detach(), proj_before), "the draft did not train"
    after = tiny_target.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], f"target tensors changed: {changed[:5]}"


def test_train_call_keeps_eval(tiny_target):
    tiny_target.train()
    assert not tiny_target.training
    assert not any(m.training for m in tiny_target.modules())
