from setuptools import find_packages, setup

setup(
    name="rlsys",
    version="0.1.0",
    description="Megatron-native RLHF / RLVR post-training for large language models",
    python_requires=">=3.10",
    packages=find_packages(include=["rlsys", "rlsys.*", "tools", "tools.*"]),
    install_requires=[
        # The Makefile installs a CPU torch first on machines without CUDA; this range
        # then installs nothing more. Never leave torch unpinned on a CPU box.
        "torch>=2.6",
        "megatron-core>=0.16,<0.17",  # 0.17+ needs Python 3.12
        "pyyaml>=6",
        "ray[default]>=2.40",
        "transformers>=5,<6",
        "safetensors>=0.4",
        "numpy",
        "psutil",  # megatron dist_checkpointing writer processes need it
        "tqdm",
        "requests",  # the rollout engines' HTTP client
        "aiohttp",  # the CPU rollout engine's server
        "matplotlib>=3.8",  # reward / length / KL / step-time plots
        "tensorboard>=2.14",
        "math-verify>=0.8",  # math answer equivalence for the "math" reward
        "pyarrow>=14",  # Parquet prompt datasets
        "setproctitle",  # a forked CPU engine shows its own command line in ps (rlsys.fork_server)
    ],
    extras_require={
        # Optional GPU acceleration: rlsys detects and uses them, and falls back without.
        # NVIDIA apex is deliberately absent: PyPI's "apex" is an unrelated package.
        "gpu": ["transformer-engine[pytorch]", "nvidia-modelopt"],
        # SGLang runs in its own environment (it pins its own torch); this extra is for that env.
        "sglang": ["sglang>=0.5.20,<0.6", "sglang-router"],
        "wandb": ["wandb>=0.17"],
        # Reading GGUF files (rlsys.convert.gguf: transformers' GGUF loader needs both).
        "gguf": ["gguf>=0.10", "accelerate"],
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.5",
            "ruff",
            "gguf>=0.10",
            "accelerate",
            "openai>=1.40",
            # the documentation site (make docs); pinned, since --strict turns a new release's warnings into failures
            "mkdocs==1.6.1",
            "mkdocs-material==9.8.2",
            "mkdocstrings[python]==1.0.8",
            "mkdocstrings-python==2.0.11",
        ],
    },
    entry_points={"console_scripts": ["rlsys=rlsys.cli:main"]},
)
