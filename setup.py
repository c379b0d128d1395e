"""Packaging for realflow.

Install torch first (a CPU wheel is fine), then everything else against
``constraints.txt`` so that pip never swaps torch for a CUDA build::

    pip install torch==2.13.0 && pip install -c constraints.txt -e ".[test]"

``install_requires`` states floors (the oldest versions known to work), so that realflow
installs beside other packages; ``constraints.txt`` pins the exact versions CI tests.
"""
from setuptools import find_packages, setup

PACKAGES = ["realflow", "graphs", "mfc", "parallel", "experiments"]

setup(
    name="realflow",
    version="0.1.0",
    description="Dataflow-graph execution engine for RL post-training of LLMs",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=[p for pkg in PACKAGES for p in (pkg, pkg + ".*")]),
    package_data={"realflow.planner": ["profiles/*.json"]},  # device profiles the planner ships
    install_requires=[
        "torch>=2.11",  # the oldest tested: the GPU check ran 2.11
        "megatron-core>=0.16.1,<0.17",  # the CPU compatibility layer (parallel/) is written for 0.16
        "transformers>=4.50",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "networkx>=3.0",
        "msgpack>=1.0",
        "pyzmq>=25",
        "numpy>=1.24",
        "tensorboard>=2.14",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "math-verify>=0.7",
        "requests>=2.28",
        "redis>=5",
        "aiohttp>=3.9",
        "einops>=0.7",
        "pyarrow>=14",  # parquet data sets
        "pyyaml>=6",  # --config files and the run's config.yaml
        "huggingface_hub>=0.24",  # hub ids resolved through the local HF cache
        "pillow>=10",  # images of vision-language data sets (through transformers' image processor)
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang"],
        "deepspeed": ["deepspeed"],
        "ray": ["ray>=2.60,<3"],  # launcher=ray (realflow/scheduler/ray.py); tested with 2.60.0
        "agents": ["openai>=2"],  # the official client, for agents behind the OpenAI-compatible proxy
        "wandb": ["wandb>=0.17"],  # wandb.mode=online|offline: stats also go to Weights & Biases
        "test": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "hypothesis>=6", "ray>=2.60,<3", "openai>=2", "wandb>=0.17",
                 "datasets>=3", "peft>=0.17", "triton>=3.4"],  # datasets: tests write saved `datasets`
        # directories; peft: LoRA is tested against PEFT's (realflow reads and writes its adapter format
        # without it); triton: the GPU's paged attention kernel, run by its interpreter on CPU
    },
    entry_points={
        "console_scripts": [
            "realflow-sft=realflow.apps.main_sft:main",
            "realflow-sync-ppo=realflow.apps.main_sync_ppo:main",
            "realflow-async-ppo=realflow.apps.main_async_ppo:main",
            "realflow=realflow.apps.main:main",
        ],
        # Plugins of other packages: modules imported by every realflow process so that their
        # registrations run (realflow.plugins.load_plugins). The built-in ones are listed in
        # realflow/plugins.py (they load uninstalled too); a package of yours adds e.g.
        # "my_pkg = my_pkg.realflow_plugin" under this group in its own setup.
        "realflow.plugins": [],
    },
)
