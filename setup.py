"""megablu: long-context training for small decoder LMs on DeepSpeed.

`pip install -e .` installs the package and the `megablu` command. The CUDA ops in csrc/
are JIT-built on first use; `MEGABLU_BUILD_OPS=1 pip install .` builds them ahead of time.
"""

import os
import re
from pathlib import Path

from setuptools import find_packages, setup

# the one source of the version: megablu/__init__.py (read, not imported: setup needs no torch)
VERSION = re.search(
    r'^__version__ = "([^"]+)"$', (Path(__file__).parent / "megablu" / "__init__.py").read_text(), re.M
).group(1)
# optional kernels (memory.loss: liger, memory.attention: fa4; CUDA only) and trackers (train.tracker):
# declared here, installed only on request, e.g. `pip install 'megablu[gpu]'`
KERNELS = {"liger": ["liger-kernel>=0.8.5"], "fa4": ["flash-attn-4>=4.0.0b40"]}
TRACKERS = {"wandb": ["wandb>=0.31"], "trackio": ["trackio>=0.43"]}

ext_modules, cmdclass = [], {}
if os.environ.get("MEGABLU_BUILD_OPS") == "1":
    # Imported lazily: a plain install must not need torch at setup time.
    from torch.utils.cpp_extension import BuildExtension

    from megablu.ops.builder import aot_extension  # noqa: E402

    ext_modules = [aot_extension()]
    cmdclass = {"build_ext": BuildExtension}

setup(
    name="megablu",
    version=VERSION,
    description="Long-context (YaRN + Ulysses SP + ZeRO) training and evaluation on DeepSpeed",
    license="Apache-2.0",
    packages=find_packages(include=["megablu", "megablu.*"]),
    package_data={"megablu": ["assets/*", "data/assets/*", "eval/assets/*", "eval/assets/ruler/*", "../csrc/**/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    # Versions pinned for CI live in requirements.txt; these are the compatible ranges.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19",
        "pydantic>=2.6",
        "pyyaml>=6",
        "tiktoken>=0.7",
        "sentencepiece>=0.2",
        "huggingface_hub>=0.24",
        "safetensors>=0.4",
        "tqdm>=4.66",
        "numpy>=1.26",
    ],
    # gguf: `megablu ckpt import-gguf` (model/gguf.py)
    extras_require={
        "hf": ["transformers>=4.56"],
        "gguf": ["gguf>=0.17.1"],
        "test": ["pytest>=8", "transformers>=4.56"],
        **KERNELS,
        "gpu": KERNELS["liger"] + KERNELS["fa4"],
        **TRACKERS,
    },
    entry_points={"console_scripts": ["megablu=megablu.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
