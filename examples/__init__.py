"""Runnable examples for ``lightning_rudra`` (MNIST-1D and the Rudra paper's CIFAR10 recipe)."""
