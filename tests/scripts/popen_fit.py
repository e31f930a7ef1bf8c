"""Train with the popen launcher (Lightning re-runs this script for every learner), save a checkpoint after fit,
resume from that checkpoint at once with a second Trainer in the same processes, then test with the first. A third
argument sets ``min_learners`` (the strategy's own popen launcher, which ends lost learners once training is over:
it must not wait for the others, which run this script on).

Learner 0 prints one JSON line: the strategy's stats, the test loss and a checksum of the final weights. Every learner
writes its torch threads to ``threads_<rank>.txt``.
"""

import json
import sys

import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import Scheduled, flat, loader, quiet_trainer

if __name__ == "__main__":
    protocol, learners = sys.argv[1], int(sys.argv[2])
    elastic = {"min_learners": int(sys.argv[3])} if len(sys.argv) > 3 else {}
    model = Scheduled(lr=0.02, momentum=0.5)
    trainer = quiet_trainer(RudraStrategy(protocol=protocol, rpc_timeout=60, **elastic), learners, max_epochs=2)
    trainer.fit(model, loader(8), loader(64, seed=1))
    with open(f"threads_{trainer.global_rank}.txt", "w") as f:  # every learner's, as DDP's learners would have
        f.write(str(torch.get_num_threads()))
    stats = trainer.strategy.stats
    trainer.save_checkpoint("after_fit.ckpt")  # after fit: the server is gone, its state must not be
    # A second Trainer in the same processes, at once (the first stage's rendezvous may still be closing), resumes
    # from that checkpoint; then the first Trainer's next stage.
    again = quiet_trainer(RudraStrategy(protocol=protocol, rpc_timeout=60, **elastic), learners, max_epochs=3)
    again.fit(Scheduled(lr=0.02, momentum=0.5), loader(8), ckpt_path="after_fit.ckpt")
    [result] = trainer.test(model, loader(64, seed=1), verbose=False)
    if trainer.is_global_zero:
        saved = torch.load("after_fit.ckpt", weights_only=False)
        print(
            "RESULT "
            + json.dumps(
                {
                    "stats": stats.to_dict(),
                    "test_loss": result["test_loss"],
                    "weights": flat(model.parameters()).sum().item(),
                    "finite": bool(torch.isfinite(flat(model.parameters())).all()),
                    "saved_state": len(saved["optimizer_states"][0]["state"]),
                    "saved_lr": saved["optimizer_states"][0]["param_groups"][0]["lr"],
                    "saved_clock": saved["rudra"]["stats"]["clock"],
                    "again_clock": again.strategy.stats.clock,
                    "again_lr": again.optimizers[0].param_groups[0]["lr"],
                }
            )
        )
