"""Build the one megablu CUDA extension (csrc/): JIT on first use, ahead of time in setup.py.

- `load()`: the extension module, built once per process with
  `torch.utils.cpp_extension.load` and cached on disk (torch's extension cache,
  ~/.cache/torch_extensions/<py>_<cu>/megablu_ops_<hash>/). The module name carries a hash
  of every source file, so editing a kernel rebuilds instead of loading a stale .so. An
  ahead-of-time build (`MEGABLU_BUILD_OPS=1 pip install .` -> `megablu.ops._megablu_ops`)
  is preferred when its embedded hash matches the sources.
- `aot_extension()`: the `CUDAExtension` setup.py builds.
- `python -m megablu.ops.builder --compile-only [--bindings]`: nvcc on every .cu for sm_90
  (no GPU needed); with --bindings also a syntax check of the torch-facing .cpp files.
  Exit 0 on success, 1 on a compile error, 3 when nvcc is missing.
- `python -m megablu.ops.builder --build`: JIT-build (or load) now and print where.

The arch list is torch's: TORCH_CUDA_ARCH_LIST if set (e.g. "9.0" for Hopper, where
the build machine sees no GPU), else the visible GPUs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
EXT_PREFIX = "megablu_ops"
AOT_NAME = "megablu.ops._megablu_ops"
# No -std here: torch's build adds the standard its headers need (C++17 or C++20 by version).
CXX_FLAGS = ["-O3"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]

_loaded = None  # the module, once built/loaded in this process
_load_error: Optional[BaseException] = None


def csrc_dir() -> Path:
    if not (CSRC / "megablu_ops.cpp").is_file():
        raise FileNotFoundError(
            f"megablu ops: sources not found at {CSRC} (csrc/ travels with the repo; "
            "an installed wheel without it needs MEGABLU_BUILD_OPS=1 at install time)"
        )
    return CSRC


def sources(root: Optional[Path] = None) -> list[Path]:
    """Every translation unit of the extension: the binding module, then csrc/<op>/*.{cpp,cu}."""
    root = root or csrc_dir()
    ops = sorted(p for p in root.glob("*/*") if p.suffix in (".cpp", ".cu") and p.parent.name != "includes")
    return [root / "megablu_ops.cpp", *ops]


def headers(root: Optional[Path] = None) -> list[Path]:
    root = root or csrc_dir()
    return sorted(p for p in (root / "includes").glob("*") if p.suffix in (".h", ".cuh"))


def source_hash(root: Optional[Path] = None) -> str:
    """sha256 over the names and bytes of every source and header, first 12 hex digits."""
    root = root or csrc_dir()
    h = hashlib.sha256()
    for p in [*sources(root), *headers(root)]:
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _hash_define(digest: str) -> str:
    # a bare token (stringified in megablu_ops.cpp): survives both ninja's shell and setuptools
    return f"-DMEGABLU_OPS_HASH={digest}"


def aot_extension():
    """The CUDAExtension for setup.py (paths relative to the project root, where setup.py runs)."""
    from torch.utils.cpp_extension import CUDAExtension

    root = csrc_dir()
    proj = root.parent
    digest = source_hash(root)
    return CUDAExtension(
        name=AOT_NAME,
        sources=[os.path.relpath(p, proj) for p in sources(root)],
        include_dirs=[str(root / "includes")],
        extra_compile_args={"cxx": [*CXX_FLAGS, _hash_define(digest)], "nvcc": [*NVCC_FLAGS, _hash_define(digest)]},
    )


def _try_aot(digest: str):
    try:
        import importlib

        mod = importlib.import_module(AOT_NAME)
    except ImportError:
        return None
    if mod.source_hash() != digest:
        log.info(
            "megablu ops: ahead-of-time build is stale (hash %s != sources %s); JIT-building", mod.source_hash(), digest
        )
        return None
    return mod


def load(verbose: bool = False):
    """The extension module (AOT build if current, else JIT). Raises if it cannot be built;
    a failure is remembered so later calls fail fast instead of recompiling."""
    global _loaded, _load_error
    if _loaded is not None:
        return _loaded
    if _load_error is not None:
        raise RuntimeError(f"megablu ops: earlier build failed: {_load_error}") from _load_error
    try:
        root = csrc_dir()
        digest = source_hash(root)
        mod = _try_aot(digest)
        if mod is None:
            from torch.utils.cpp_extension import load as torch_load

            t0 = time.perf_counter()
            mod = torch_load(
                name=f"{EXT_PREFIX}_{digest}",
                sources=[str(p) for p in sources(root)],
                extra_include_paths=[str(root / "includes")],
                extra_cflags=[*CXX_FLAGS, _hash_define(digest)],
                extra_cuda_cflags=[*NVCC_FLAGS, _hash_define(digest)],
                verbose=verbose,
            )
            log.info("megablu ops: extension %s_%s ready in %.1f s", EXT_PREFIX, digest, time.perf_counter() - t0)
        _loaded = mod
        return mod
    except BaseException as e:  # noqa: BLE001 - remembered and re-raised; dispatch logs the reason
        _load_error = e
        raise


# ---------------------------------------------------------------------------------------
# compile-only check (CI without a GPU)
# ---------------------------------------------------------------------------------------


def find_nvcc() -> Optional[str]:
    cand = shutil.which("nvcc")
    if cand:
        return cand
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def _run(cmd: list[str]) -> tuple[int, str]:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, p.stdout


def nvcc_cmd(nvcc: str, src: Path, out: Path, arch: str = "90") -> list[str]:
    # the kernels need no torch header: C++17 suffices, and proves they do not rely on C++20;
    # torch's build defines the __CUDA_NO_*__ macros, so the check does too
    return [
        nvcc,
        "-c",
        "-std=c++17",
        *TORCH_NVCC_DEFINES,
        *NVCC_FLAGS,
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-Xptxas=-v",
        f"-I{csrc_dir() / 'includes'}",
        str(src),
        "-o",
        str(out),
    ]


def _torch_wants_cxx20() -> bool:
    import inspect

    import torch.utils.cpp_extension as ce

    return "-std=c++20" in inspect.getsource(ce)


def _binding_cmd(src: Path, stub: Path, nvcc: str) -> Optional[list[str]]:
    """g++ -fsyntax-only for a torch-facing .cpp, or None when torch's headers are absent."""
    try:
        from torch.utils.cpp_extension import include_paths
    except ImportError:
        return None
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return None
    homes = [os.environ.get("CUDA_HOME"), str(Path(nvcc).resolve().parents[1]), "/usr/local/cuda"]
    cuda_inc = next((Path(h) / "include" for h in homes if h and (Path(h) / "include/cuda_runtime.h").is_file()), None)
    if cuda_inc is None:
        return None
    incs = [
        csrc_dir() / "includes",
        stub,
        *map(Path, include_paths()),
        cuda_inc,
        Path(sysconfig.get_paths()["include"]),
    ]
    std = "-std=c++20" if _torch_wants_cxx20() else "-std=c++17"
    return [cxx, "-fsyntax-only", std, f"-DTORCH_EXTENSION_NAME={EXT_PREFIX}", *[f"-I{p}" for p in incs], str(src)]


def compile_only(arch: str = "90", bindings: bool = False, jobs: Optional[int] = None) -> int:
    """nvcc every .cu for sm_<arch> (and optionally syntax-check the .cpp bindings)."""
    nvcc = find_nvcc()
    if nvcc is None:
        print("compile-only: nvcc not found (PATH, CUDA_HOME, /usr/local/cuda); nothing compiled", file=sys.stderr)
        return 3
    root = csrc_dir()
    cus = [p for p in sources(root) if p.suffix == ".cu"]
    cpps = [p for p in sources(root) if p.suffix == ".cpp"] if bindings else []
    failed = 0
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # A CPU-only torch wheel ships c10/cuda headers but not the generated
        # cuda_cmake_macros.h; a stub suffices for a syntax check (never for a real build).
        stub = tmp / "stub"
        (stub / "c10/cuda/impl").mkdir(parents=True)
        (stub / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        jobs_list = [(p, nvcc_cmd(nvcc, p, tmp / (p.stem + ".o"), arch)) for p in cus]
        for p in cpps:
            cmd = _binding_cmd(p, stub, nvcc)
            if cmd is None:
                print(
                    f"compile-only: skip {p.relative_to(root.parent)} (torch headers, CUDA headers or c++ missing)",
                    file=sys.stderr,
                )
            else:
                jobs_list.append((p, cmd))
        with cf.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as ex:
            futs = {ex.submit(_run, cmd): (p, time.perf_counter()) for p, cmd in jobs_list}
            for fut in cf.as_completed(futs):
                p, _ = futs[fut]
                rc, out = fut.result()
                rel = p.relative_to(root.parent)
                spills = [ln.strip() for ln in out.splitlines() if "spill" in ln and " 0 bytes spill stores" not in ln]
                if rc != 0:
                    failed += 1
                    print(f"FAIL {rel}\n{out}", file=sys.stderr)
                else:
                    note = f" ({len(spills)} kernels spill registers)" if spills else ""
                    print(f"ok   {rel}{note}")
    print(f"compile-only: {len(jobs_list) - failed}/{len(jobs_list)} ok (nvcc {nvcc}, sm_{arch})")
    return 1 if failed else 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megablu.ops.builder", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--compile-only", action="store_true", help="nvcc every .cu for sm_90, no GPU needed")
    g.add_argument("--build", action="store_true", help="JIT-build (or load the cached) extension now")
    g.add_argument("--hash", action="store_true", help="print the source hash")
    ap.add_argument("--bindings", action="store_true", help="with --compile-only: also syntax-check the .cpp")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.hash:
        print(source_hash())
        return 0
    if args.compile_only:
        return compile_only(args.arch, args.bindings)
    t0 = time.perf_counter()
    mod = load(verbose=args.verbose)
    print(f"megablu ops built/loaded: {mod.__file__} (hash {mod.source_hash()}, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
