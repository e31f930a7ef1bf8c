from setuptools import find_packages, setup

setup(
    name="lightning_rudra",
    version="0.2.0.dev0",
    description="Parameter-server training for PyTorch Lightning: hardsync, n-softsync and async protocols "
                "with staleness-aware learning rates (Rudra, ICDM 2016).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["lightning_rudra", "lightning_rudra.*"]),
    python_requires=">=3.10",
    # torch is left open on purpose: install the build you want first (see README).
    install_requires=["torch>=2.3", "pytorch-lightning>=2.6,<2.7", "torchmetrics>=1.0"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2", "lightning>=2.6,<2.7", "jsonargparse[signatures]>=4.27", "mnist1d>=0.0.2"],
        "examples": ["jsonargparse[signatures]>=4.27", "mnist1d>=0.0.2", "matplotlib>=3.5"],
    },
)
