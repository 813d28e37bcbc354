"""Train with the Hydra app, e.g. ``python examples/train.py strategy=plain trainer.max_steps=100``.

Same as the ``megatrain-train`` console script; configs live in ``megatrain_lightning/configs``.
"""

from megatrain_lightning.train import main

if __name__ == "__main__":
    main()
